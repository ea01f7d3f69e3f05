"""normkit explain: groups come from normkit.grouping, the worked example matches the
source article and torch, and the command writes valid PNGs."""

import numpy as np
import pytest
from conftest import ARTICLE_OUTPUT

from normkit.cli.explain import drawing as ex
from normkit import grouping as G

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _shared(x, ids):
    """Per-group mean computed by brute force over the ids, broadcast back."""
    out = np.empty_like(x)
    for g in np.unique(ids):
        out[ids == g] = x[ids == g].mean()
    return out


@pytest.mark.parametrize("key", list(ex.METHODS))
def test_group_ids_reproduce_the_grouping_statistics(key):
    # the groups drawn must be exactly the sets the grouping's reduction averages over
    e = ex.explain(key)
    x = np.random.default_rng(0).normal(size=e.shape)
    g = e.grouping
    by_grouping = np.broadcast_to(x.reshape(g.view).mean(axis=g.reduce, keepdims=True), g.view).reshape(e.shape)
    np.testing.assert_allclose(_shared(x, e.ids), by_grouping, rtol=0, atol=1e-12)
    assert e.n_groups * e.group_size == x.size


def test_expected_groups_on_the_block():
    n, c, s = ex.BLOCK
    assert ex.explain("batch").n_groups == c
    assert ex.explain("layer").n_groups == n
    assert ex.explain("instance").n_groups == n * c
    assert ex.explain("group").n_groups == n * ex.GN_GROUPS
    # the scalers: one group per column of the table
    ids = ex.explain("standard-scaler").ids
    assert (ids == np.arange(ex.TABLE[1])[None, :]).all()


def test_group_ids_of_odd_shape_match_torch_group_norm():
    torch = pytest.importorskip("torch")
    shape, groups = (3, 6, 7), 3
    ids = ex.group_ids(shape, G.group(shape, groups))
    x = torch.randn(shape, dtype=torch.float64)
    y = torch.nn.functional.group_norm(x, groups, eps=0.0).numpy()
    xn = x.numpy()
    mean, var = _shared(xn, ids), _shared((xn - _shared(xn, ids)) ** 2, ids)
    np.testing.assert_allclose((xn - mean) / np.sqrt(var), y, atol=1e-10)


def test_worked_example_matches_article_and_torch():
    torch = pytest.importorskip("torch")
    w = ex.worked_example()
    np.testing.assert_allclose(w["out"], ARTICLE_OUTPUT, atol=5e-5)
    layer = torch.nn.LayerNorm(5).double()
    with torch.no_grad():
        expected = layer(torch.from_numpy(ex.WORKED_INPUT)).numpy()
    np.testing.assert_allclose(w["out"], expected, atol=1e-12)
    assert w["mean"][0, 0] == pytest.approx((49 + 90 + 29 + 76 + 33) / 5)
    assert w["var"][0, 0] == pytest.approx(np.var([49, 90, 29, 76, 33]))


def test_text_rendering():
    text = ex.render_text(ex.explain("batch"))
    rows = [line for line in text.splitlines() if line.strip().startswith("c=")]
    assert len(rows) == ex.BLOCK[1]
    assert rows[0].split()[1:] == ["AAAAA"] * ex.BLOCK[0]       # channel 0: one group across the batch
    walk = ex.render_worked_example()
    assert "55.4000" in walk and "572.2400" in walk
    assert "[-0.2675,  1.4464, -1.1036,  0.8611, -0.9364]" in walk


def test_unknown_method_says_what_to_pass():
    with pytest.raises(ValueError, match="choose one of"):
        ex.resolve("weightnorm")
    assert ex.resolve("GroupNorm") == "group"


def test_cli_explain_writes_pngs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from normkit.cli import main

    assert main(["explain", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "BatchNorm" in out and "MinMaxScaler" in out and "Worked example" in out
    names = {p.name for p in tmp_path.iterdir()}
    expected = {f"explain-{k}.png" for k in ex.METHODS} | {"explain-layers.png", "layernorm-example.png"}
    assert expected <= names
    for name in expected:
        data = (tmp_path / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 2000


def test_cli_explain_one_method(tmp_path, capsys):
    from normkit.cli import main

    assert main(["explain", "gn"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("GroupNorm") and "Worked example" not in out
    assert main(["explain", "nope"]) == 2
