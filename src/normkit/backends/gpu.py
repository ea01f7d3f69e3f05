"""GPU backend: fused Triton kernels for every normalization on CUDA tensors.

Same interface as ``normkit.backends.torch_ops`` (``supports``, ``forward``,
``backward``), plus the residual-add variant used by ``normkit.functional.add_layer_norm``
and ``add_rms_norm`` (``fused_add_forward``, ``fused_add_backward``). The dispatch in
``normkit.backends`` skips this module when triton (the ``gpu`` extra) is not installed:
importing it raises ImportError then. Triton itself, and the kernels in
``normkit.backends._gpu_kernels``, are imported on the first CUDA tensor, so CPU-only
use never pays for it, and nothing here touches ``TRITON_INTERPRET``: the interpreter
tests set it in their own process and call ``forward``/``backward`` on CPU tensors, which
``supports`` never accepts.

Statistics are fp32 for fp32, bf16 and fp16 inputs (fp64 goes to the composite path);
every output is cast once. Design, per family (see ``docs/gpu.md``):

LayerNorm / RMSNorm (``_rows_*``), an (M, K) view of rows:
    forward   one program per row; the row's mean and M2 from per-block two-passes
              merged by Chan's rule, then the output -- two reads of the row, one when
              it fits a block (kept in registers). An optional residual is added first
              and ``h = x + r`` written out.
    backward  P programs, each over a contiguous chunk of rows: ``dx = rstd * (dxhat -
              c_mean - xhat * c_var)``. When a row fits a block each program also
              accumulates its rows' ``g * xhat`` and ``g`` in registers and writes them
              to row p of a (P, K) buffer; otherwise a second kernel, tiled (row chunk x
              column block), does so. The buffer is then summed over P: a two-stage
              reduction, no atomics.
Batch / Instance / GroupNorm (``_nc_*``), an (N, C, S) view with any strides:
    stats     tiles of (channels x positions) give per-(n, c) mean and M2 over P ranges
              of positions (two-pass per tile, Chan merge across tiles); the (N, P, C)
              partials are Chan-merged into the grouping's statistics in float64 (over
              parts; and over samples for BatchNorm, over the group's channels for
              GroupNorm).
    apply     ``y = (x - mu) * (rstd * w) + b`` with per-(n, c) coefficients.
    backward  per-(n, c) partial sums of ``g`` and ``g * xhat`` (same tiling), summed to
              dbias/dweight and to the group sums c_var, c_mean; then the apply kernel
              writes ``dx = g * scale_g + (x - mu) * a + b`` (``scale_g = rstd w``,
              ``a = -rstd^2 c_var``, ``b = -rstd c_mean``).
The tiles are wide along whichever of channels and positions is contiguous, so contiguous
NCHW and channels_last both read memory in order.
"""

from __future__ import annotations

import importlib.util

import torch

from normkit.backends import fused_kernels_cover

if importlib.util.find_spec("triton") is None:
    raise ImportError("the GPU backend needs triton: pip install 'normkit[gpu]'")

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Block sizes (elements). Rows up to ROW_BLOCK_MAX stay in registers; longer ones are
# looped over in blocks of that size. TILE_MAX bounds a (channels x positions) tile and
# CL_BLOCK_C its channel side when channels are contiguous. The interpreter tests shrink
# these to run every loop on small shapes.
ROW_BLOCK_MAX = 8192
TILE_MAX = 2048
CL_BLOCK_C = 64
PROGRAMS_PER_SM = 4
INTERPRETER_SMS = 4   # the "device" of CPU tensors in interpreter mode

_kernels = None


def _k():
    """The kernels module; imports triton on first use."""
    global _kernels
    if _kernels is None:
        from normkit.backends import _gpu_kernels
        _kernels = _gpu_kernels
    return _kernels


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_SMS


def _warps(block: int) -> int:
    return min(16, max(1, block // 256))


def _ncs(xv, grouping):
    """The (N, C, S) view of a batch/instance/group view (None if the strides do not
    allow one without a copy)."""
    if grouping.kind != "group":
        return xv
    v = grouping.view
    try:
        return xv.view(v[0], v[1] * v[2], v[3])
    except RuntimeError:
        return None


def supports(x, grouping, center=True, fixed=False) -> bool:
    if (x.device.type != "cuda" or x.dtype not in _DTYPES
            or not fused_kernels_cover(x, grouping, center, fixed)):
        return False
    if tuple(x.shape) != tuple(grouping.view):
        return False
    return grouping.kind == "layer" or _ncs(x, grouping) is not None


# ---------------------------------------------------------------------------------------
# rows: LayerNorm / RMSNorm (+ residual)
# ---------------------------------------------------------------------------------------

def _row_block(k):
    block = min(_pow2(k), ROW_BLOCK_MAX)
    return block, k <= block


def _flat(p, k):
    return None if p is None else p.detach().reshape(k).contiguous()


def rows_forward(x, residual, weight, bias, eps, center):
    """LayerNorm (``center``) or RMSNorm of the rows of an (M, K) tensor, after adding
    ``residual`` if given. Returns ``(y, h, mean, rstd, var)``; ``h = x + residual`` in
    x's dtype (None without residual), statistics (M,) fp32."""
    m, k = x.shape
    x = x.contiguous()
    w, b = _flat(weight, k), _flat(bias, k)
    y = torch.empty_like(x)
    h = None
    if residual is not None:
        residual = residual.contiguous()
        h = torch.empty_like(x)
    mean, rstd, var = (torch.empty(m, dtype=torch.float32, device=x.device) for _ in range(3))
    block, single = _row_block(k)
    _k()._rows_fwd_kernel[(m,)](
        x, x if residual is None else residual, x if h is None else h, y,
        x if w is None else w, x if b is None else b, mean, rstd, var, k, k, float(eps),
        HAS_RES=residual is not None, HAS_W=w is not None, HAS_B=b is not None,
        CENTER=bool(center), SINGLE=single, BLOCK=block, num_warps=_warps(block))
    return y, h, mean, rstd, var


def rows_backward(grad, saved, grad_h, weight, bias, mean, rstd, center, from_y, needs):
    """Gradients of ``rows_forward``: ``(dx, dweight, dbias)`` with dweight/dbias (K,)
    fp32 (None unless asked for in ``needs``). ``saved`` is the normalized input h (or
    x), or the output y when ``from_y`` (memory-saving: ``xhat = (y - b) / w``, every
    weight element nonzero). ``grad_h``, if given, is added to dx (the gradient that
    reaches ``h = x + residual`` directly)."""
    m, k = saved.shape
    saved, grad = saved.contiguous(), grad.contiguous()
    if grad_h is not None:
        grad_h = grad_h.contiguous()
    w, b = _flat(weight, k), _flat(bias, k)
    dx = torch.empty_like(saved)
    block, single = _row_block(k)
    rows_per_prog = _cdiv(m, min(m, _sms(saved.device) * PROGRAMS_PER_SM))
    programs = _cdiv(m, rows_per_prog)
    dwp = torch.empty((programs, k), dtype=torch.float32, device=saved.device)   # P, K
    dbp = torch.empty((programs, k), dtype=torch.float32, device=saved.device)   # P, K
    flags = dict(HAS_W=w is not None, HAS_B=b is not None, FROM_Y=bool(from_y),
                 BLOCK=block, num_warps=_warps(block))
    kern = _k()
    kern._rows_bwd_kernel[(programs,)](
        grad, saved, saved if grad_h is None else grad_h, saved if w is None else w,
        saved if b is None else b, rstd if mean is None else mean, rstd, dx, dwp, dbp, m, k,
        rows_per_prog,
        k, k, k, k, HAS_GH=grad_h is not None, CENTER=bool(center), SINGLE=single, **flags)
    if not single and (needs[1] or needs[2]):
        kern._rows_param_kernel[(programs, _cdiv(k, block))](
            grad, saved, saved if w is None else w, saved if b is None else b,
            rstd if mean is None else mean, rstd, dwp, dbp, m, k, rows_per_prog, k, k, **flags)
    dw = dwp.sum(0) if needs[1] else None                          # second stage: K
    db = dbp.sum(0) if needs[2] else None
    return (dx if needs[0] else None), dw, db


def fused_add_forward(x, residual, weight, bias, eps, center):
    """``h = x + residual`` and its LayerNorm/RMSNorm in one pass over (M, K) views:
    ``(y, h, mean, rstd)``."""
    y, h, mean, rstd, _ = rows_forward(x, residual, weight, bias, eps, center)
    return y, h, mean, rstd


def fused_add_backward(grad_y, grad_h, saved, mean, rstd, weight, bias, center, from_y,
                       needs):
    """``(dh, dweight, dbias)`` of ``fused_add_forward``; ``dh`` is the gradient of x and
    of the residual alike."""
    return rows_backward(grad_y, saved, grad_h, weight, bias, mean, rstd, center, from_y,
                         needs)


# ---------------------------------------------------------------------------------------
# per (n, c): Batch / Instance / GroupNorm over (N, C, S)
# ---------------------------------------------------------------------------------------

def _tiles(x3):
    """``(block_c, block_s, parts, s_per_part)``: the tile, wide along the contiguous
    side, and the split of the positions into parts so that there are a few programs
    per SM."""
    n, c, s = x3.shape
    if x3.stride(1) == 1 and x3.stride(2) != 1:                   # channels contiguous
        block_c = min(_pow2(c), CL_BLOCK_C, TILE_MAX)
        block_s = max(1, min(_pow2(s), TILE_MAX // block_c))
    else:                                                          # positions contiguous
        block_s = min(_pow2(s), TILE_MAX)
        block_c = max(1, min(_pow2(c), TILE_MAX // block_s))
    programs = n * _cdiv(c, block_c)
    blocks_s = _cdiv(s, block_s)
    parts = max(1, min(blocks_s, _cdiv(_sms(x3.device) * PROGRAMS_PER_SM, programs)))
    s_per_part = _cdiv(blocks_s, parts) * block_s
    return block_c, block_s, _cdiv(s, s_per_part), s_per_part


def _per_nc(t, grouping, n, c):
    """Statistics shaped ``grouping.stat_shape`` as per-(n, c) (N, C) fp32."""
    t = t.to(torch.float32)
    if grouping.kind == "group":
        g = grouping.view[1]
        return t.reshape(n, g, 1).expand(n, g, c // g).reshape(n, c).contiguous()
    return t.reshape(-1, c).expand(n, c).contiguous()


def _group_view(t, grouping, n, c):
    """A per-(n, c) tensor seen as (N, G, C/G); BatchNorm and InstanceNorm: (N, C, 1)."""
    if grouping.kind == "group":
        return t.view(n, grouping.view[1], c // grouping.view[1])
    return t.view(n, c, 1)


def _group_axes(grouping):
    """Axes of the (N, G, C/G) view that one statistic sums over."""
    return (0, 2) if grouping.kind == "batch" else (2,)


def _merge(pmean, pm2, counts, grouping, n, c):
    """Chan merge of per-(n, part, c) moments into the grouping's (mean, var), float64:
    ``mean = sum(n_i mean_i) / n``, ``M2 = sum(M2_i + n_i (mean_i - mean)^2)``."""
    parts = pmean.shape[1]
    groups = grouping.view[1] if grouping.kind == "group" else c
    gv = (n, parts, groups, c // groups)                           # N, P, G, C/G
    pm, q = pmean.double().view(gv), pm2.double().view(gv)
    cnt = counts.double().view(1, parts, 1, 1)
    axes = (1,) + tuple(a if a == 0 else a + 1 for a in _group_axes(grouping))   # +P
    total = cnt.expand(gv).sum(axes, keepdim=True)
    mean = (pm * cnt).sum(axes, keepdim=True) / total
    m2 = (q + cnt * (pm - mean) ** 2).sum(axes, keepdim=True)
    return mean, m2 / total


def _launch_affine(x3, g3, out3, mu, mu_lo, a, b, scale_g, tiles):
    n, c, s = x3.shape
    block_c, block_s, parts, spp = tiles
    g = x3 if g3 is None else g3
    _k()._nc_affine_kernel[(n, _cdiv(c, block_c), parts)](
        x3, g, out3, mu, mu_lo, a, b, a if scale_g is None else scale_g, c, s, spp,
        *x3.stride(), *g.stride(), *out3.stride(), HAS_G=g3 is not None, BLOCK_C=block_c,
        BLOCK_S=block_s, num_warps=_warps(block_c * block_s))


def _nc_forward(x, grouping, weight, bias, eps, mean, rstd):
    x3 = _ncs(x, grouping)
    n, c, s = x3.shape
    dev = x.device
    tiles = _tiles(x3)
    block_c, block_s, parts, spp = tiles
    var = None
    if mean is None:
        pmean = torch.empty((n, parts, c), dtype=torch.float64, device=dev)   # N, P, C
        pm2 = torch.empty((n, parts, c), dtype=torch.float32, device=dev)
        _k()._nc_moments_kernel[(n, _cdiv(c, block_c), parts)](
            x3, pmean, pm2, c, s, spp, *x3.stride(), BLOCK_C=block_c, BLOCK_S=block_s,
            num_warps=_warps(block_c * block_s))
        counts = (s - spp * torch.arange(parts, device=dev)).clamp(0, spp)    # P
        mean64, var64 = _merge(pmean, pm2, counts, grouping, n, c)
        shape = grouping.stat_shape
        mean = mean64.to(torch.float32).view(shape)
        var = var64.to(torch.float32).view(shape)
        rstd = torch.rsqrt(var64 + eps).to(torch.float32).view(shape)
        mu_lo = _per_nc(mean64 - mean.double().view(mean64.shape), grouping, n, c)
    else:
        mu_lo = torch.zeros((n, c), dtype=torch.float32, device=dev)
    mu = _per_nc(mean, grouping, n, c)                             # N, C: mean = mu + mu_lo
    rs = _per_nc(rstd, grouping, n, c)
    w = torch.ones(c, device=dev) if weight is None else weight.detach().reshape(c).float()
    b = torch.zeros(c, device=dev) if bias is None else bias.detach().reshape(c).float()
    y3 = torch.empty_like(x3)                                      # keeps the layout
    _launch_affine(x3, None, y3, mu, mu_lo, (rs * w).contiguous(),
                   b.expand(n, c).contiguous(), None, tiles)
    return y3.view(grouping.view), mean, rstd, var


def _nc_backward(grad, x, mean, rstd, weight, grouping, center, fixed, needs):
    x3 = _ncs(x, grouping)
    n, c, s = x3.shape
    dev = x.device
    g3 = grad.reshape(n, c, s)
    tiles = _tiles(x3)
    block_c, block_s, parts, spp = tiles
    mu = _per_nc(mean, grouping, n, c)                             # N, C
    mu_lo = torch.zeros_like(mu)
    rs = _per_nc(rstd, grouping, n, c)
    psg = torch.empty((n, parts, c), dtype=torch.float32, device=dev)       # N, P, C
    psgx = torch.empty((n, parts, c), dtype=torch.float32, device=dev)
    _k()._nc_grad_sums_kernel[(n, _cdiv(c, block_c), parts)](
        g3, x3, mu, mu_lo, rs, psg, psgx, c, s, spp, *g3.stride(), *x3.stride(),
        BLOCK_C=block_c, BLOCK_S=block_s, num_warps=_warps(block_c * block_s))
    sg, sgx = psg.double().sum(1), psgx.double().sum(1)           # second stage: N, C
    dx = None
    if needs[0]:
        w = (torch.ones(c, device=dev, dtype=torch.float64) if weight is None
             else weight.detach().reshape(c).double())
        rs64 = rs.double()
        if fixed:
            c_var = c_mean = torch.zeros_like(sg)
        else:
            axes, cnt = _group_axes(grouping), grouping.group_size
            gv = _group_view(sg, grouping, n, c).shape
            c_var = ((w * sgx).view(gv).sum(axes, keepdim=True) / cnt).expand(gv).reshape(n, c)
            c_mean = ((w * sg).view(gv).sum(axes, keepdim=True) / cnt).expand(gv).reshape(n, c)
            if not center:
                c_mean = torch.zeros_like(c_mean)
        scale_g = (rs64 * w).float().contiguous()
        a = (-rs64 * rs64 * c_var).float().contiguous()
        b = (-rs64 * c_mean).float().contiguous()
        dx3 = torch.empty_like(x3)
        _launch_affine(x3, g3, dx3, mu, mu_lo, a, b, scale_g, tiles)
        dx = dx3.view(grouping.view)
    pshape = grouping.param_view
    dw = sgx.sum(0).float().view(pshape) if needs[1] else None
    db = sg.sum(0).float().view(pshape) if needs[2] else None
    return dx, dw, db


# ---------------------------------------------------------------------------------------
# the backend interface
# ---------------------------------------------------------------------------------------

def forward(x, grouping, weight, bias, eps, center=True, mean=None, rstd=None):
    if grouping.kind != "layer":
        return _nc_forward(x, grouping, weight, bias, eps, mean, rstd)
    y, _, mean, rstd, var = rows_forward(x, None, weight, bias, eps, center)
    shape = grouping.stat_shape
    return y.view(grouping.view), mean.view(shape), rstd.view(shape), var.view(shape)


def backward(grad, x, mean, rstd, weight, grouping, center, fixed, needs):
    if grouping.kind != "layer":
        return _nc_backward(grad, x, mean, rstd, weight, grouping, center, fixed, needs)
    m, k = grouping.view
    dx, dw, db = rows_backward(grad, x, None, weight, None, mean.reshape(m).float(),
                               rstd.reshape(m).float(), center, False, needs)
    pshape = grouping.param_view
    return dx, (None if dw is None else dw.view(pshape)), (None if db is None else db.view(pshape))


__all__ = ["supports", "forward", "backward", "fused_add_forward", "fused_add_backward",
           "rows_forward", "rows_backward"]
