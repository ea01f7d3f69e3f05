"""``normkit demo``: a short tour of the layers -- each normkit layer against torch.nn on
the same input, the source articles' worked LayerNorm example, and a model conversion."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="compare every normkit layer with torch.nn and "
                              "convert a small model (a quick tour)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch
    from torch import nn

    import normkit
    import normkit.nn as nknn
    from normkit.cli.explain.drawing import WORKED_INPUT

    torch.manual_seed(args.seed)
    layers = [
        ("BatchNorm2d(8)", (8,), (16, 8, 12, 12)),
        ("InstanceNorm2d(8, affine=True)", (8,), (16, 8, 12, 12)),
        ("GroupNorm(4, 8)", (4, 8), (16, 8, 12, 12)),
        ("LayerNorm(64)", (64,), (16, 50, 64)),
        ("RMSNorm(64)", (64,), (16, 50, 64)),
    ]
    print("normkit vs torch.nn on the same input (training mode, float32)\n")
    print(f"  {'layer':32s} {'max |dy|':>10s} {'max |dx grad|':>14s}")
    for label, ctor_args, shape in layers:
        name = label.split("(")[0]
        kwargs = {"affine": True} if name.startswith("Instance") else {}
        ours, theirs = getattr(nknn, name)(*ctor_args, **kwargs), getattr(nn, name)(*ctor_args, **kwargs)
        x = torch.randn(shape) * 3 + 2
        xo, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
        yo, yt = ours(xo), theirs(xt)
        g = torch.randn_like(yt)
        yo.backward(g)
        yt.backward(g)
        print(f"  {label:32s} {float((yo - yt).detach().abs().max()):10.2e} "
              f"{float((xo.grad - xt.grad).abs().max()):14.2e}")

    print("\nThe source articles' LayerNorm example: x of shape (2, 3, 5), LayerNorm(5)")
    x = torch.from_numpy(WORKED_INPUT).float()
    row = x[0, 0]
    mu, var = row.mean(), row.var(unbiased=False)
    print(f"  first row {row.tolist()}: mu = {mu:.4f}, sigma^2 (biased) = {var:.4f}")
    y = nknn.LayerNorm(5)(x).detach()
    print(f"  output of the first row: {[round(v, 4) for v in y[0, 0].tolist()]}")

    print("\nnormkit.convert on a small CNN with BatchNorm and LayerNorm:")
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 8), nn.LayerNorm(8))
    model.eval()
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        before = model(x)
        report = normkit.convert(model)
        after = model(x)
    print("  " + str(report).replace("\n", "\n  "))
    print(f"  max |output change| after conversion: {float((after - before).abs().max()):.2e}")
    return 0
