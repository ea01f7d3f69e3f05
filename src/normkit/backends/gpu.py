"""GPU backend: fused Triton kernels for every normalization on CUDA tensors.

Same interface as ``normkit.backends.torch_ops`` (``supports``, ``forward``,
``backward``; ``supports_activation``: BatchNorm followed by its activation, fused), plus
the residual-add variant used by ``normkit.functional.add_layer_norm``
and ``add_rms_norm`` (``fused_add_forward``, ``fused_add_backward``). The dispatch in
``normkit.backends`` skips this module when triton (the ``gpu`` extra) is not installed:
importing it raises ImportError then. Triton and the kernels
(``normkit.backends._gpu_kernels``) are imported on the first CUDA tensor, and nothing
here touches ``TRITON_INTERPRET``: the interpreter tests set it in their own process and
call ``forward``/``backward`` on CPU tensors, which ``supports`` never accepts.

Statistics are fp32 for fp32, bf16 and fp16 inputs (fp64 goes to the composite path);
every output is cast once. The two kernel families -- rows (LayerNorm / RMSNorm, an (M,
K) view) and per (n, c) (Batch / Instance / GroupNorm, an (N, C, S) view with any
strides) -- their formulas and reductions are described in the kernels' docstrings and in
``docs/gpu.md``. Every launch runs in its tensors' device context (``_device_guard``):
Triton launches on the current device, not the tensors'.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from normkit.backends import fused_kernels_cover
from normkit.grouping import view_strides

if importlib.util.find_spec("triton") is None:
    raise ModuleNotFoundError("the GPU backend needs triton: pip install 'normkit[gpu]'",
                              name="triton")

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Block sizes (elements). Rows up to ROW_BLOCK_MAX stay in registers; longer ones are
# looped over in blocks of that size. TILE_MAX bounds a (channels x positions) tile and
# CL_BLOCK_C its channel side when channels are contiguous. The interpreter tests shrink
# these to run every loop on small shapes.
ROW_BLOCK_MAX = 8192
TILE_MAX = 2048
CL_BLOCK_C = 64
STAT_BLOCK_MAX = 64     # groups side by side in a tile of the statistics kernels
STAT_TILE_MAX = 1024    # its elements (groups x partials of each)
PROGRAMS_PER_SM = 4
INTERPRETER_SMS = 4   # the "device" of CPU tensors in interpreter mode
# Kernel variants from the review of the kernels (docs/gpu.md), each a switch so that
# benchmarks/gpu_check.py can time both sides in one run; unmeasured until then.
STAGES = 3            # loads of the rows / positions loops pipelined (tl.range); 1: off
X0_MEAN = True        # the moments' shift x0: a first pass's mean, not the first element
LANES = True          # per-(n, c) sums kept per tile element, reduced once after the loop
SMALL_ROW = 256       # rows of at most this many elements: several per program; 0: off
OCCUPANCY = True      # rows backward: programs per SM from the registers its block needs

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
    return _cuda_sms(device.index) if device.type == "cuda" else INTERPRETER_SMS


@functools.lru_cache(maxsize=None)
def _cuda_sms(index) -> int:
    """Multiprocessors of a CUDA device (asked once: every launch sizes its grid by it)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def _warps(block: int) -> int:
    return min(16, max(1, block // 256))


def _device_guard(fn):
    """Run ``fn(t, ...)`` in the device context of its first argument: Triton launches
    on the current device, which need not be the tensors' (cuda:1 while cuda:0 is
    current)."""
    @functools.wraps(fn)
    def run(t, *args, **kwargs):
        if t.device.type != "cuda":                   # CPU tensors: the interpreter
            return fn(t, *args, **kwargs)
        with torch.cuda.device(t.device):
            return fn(t, *args, **kwargs)
    return run


def _ncs(xv, grouping):
    """The (N, C, S) view of a batch/instance/group view (None if the strides do not
    allow one without a copy)."""
    if grouping.kind != "group":
        return xv
    v = grouping.view
    shape = (v[0], v[1] * v[2], v[3])
    return xv.view(shape) if view_strides(xv.shape, xv.stride(), shape) is not None else None


def _merge_batch(t3, grouping):
    """The (N, C, S) view ``t3`` as the ``_nc_*`` kernels walk it. BatchNorm's statistics
    take N and S alike, so where samples and positions form one axis of memory
    (channels_last, and (N, C) BatchNorm1d, where S = 1) it is (1, C, N * S): the positions
    of the whole batch split into parts across programs, a few partials per channel,
    instead of one per sample and a serial merge over N of them."""
    n, c, s = t3.shape
    step = t3.stride(0) if s == 1 else t3.stride(2)   # along the merged axis
    if grouping.kind == "batch" and n > 1 and t3.stride(0) == s * step:
        return t3.as_strided((1, c, n * s), (n * s * step, t3.stride(1), step))
    return t3


def supports(x, grouping, center=True, fixed=False) -> bool:
    return (x.device.type == "cuda" and x.dtype in _DTYPES
            and fused_kernels_cover(x, grouping, center, fixed)
            and tuple(x.shape) == tuple(grouping.view)
            and (grouping.kind == "layer" or _ncs(x, grouping) is not None))


# -- rows: LayerNorm / RMSNorm (+ residual) ----------------------------------------------

def _row_block(k):
    block = min(_pow2(k), ROW_BLOCK_MAX)
    return block, k <= block


def _rows_per_program(k, block):
    """Rows of at most SMALL_ROW elements (per-head q/k norms) go several to a program,
    a tile of about 2048 elements, rather than one row to a one-warp program."""
    return max(1, min(16, 2048 // block)) if k <= min(block, SMALL_ROW) else 1


def _bwd_programs_per_sm(block):
    """Programs of the rows backward that one SM holds at once: 65536 registers over
    about 64 per thread for blocks up to 4096 elements, 128 above (ptxas -v for sm_90a,
    docs/gpu.md), of ``_warps(block)`` warps each; at most PROGRAMS_PER_SM."""
    if not OCCUPANCY:
        return PROGRAMS_PER_SM
    regs = 64 if block <= 4096 else 128
    return max(1, min(PROGRAMS_PER_SM, 65536 // (regs * 32 * _warps(block))))


def _flat(p, k):
    return None if p is None else p.detach().reshape(k).contiguous()


@_device_guard
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
    mean, rstd, var = torch.empty((3, m), dtype=torch.float32, device=x.device)
    block, single = _row_block(k)
    rows = _rows_per_program(k, block)
    _k()._rows_fwd_kernel[(_cdiv(m, rows),)](
        x, x if residual is None else residual, x if h is None else h, y,
        x if w is None else w, x if b is None else b, mean, rstd, var, m, k, k, float(eps),
        HAS_RES=residual is not None, HAS_W=w is not None, HAS_B=b is not None,
        CENTER=bool(center), SINGLE=single, BLOCK=block, ROWS=rows, X0_MEAN=X0_MEAN,
        num_warps=_warps(block * rows))
    return y, h, mean, rstd, var


@_device_guard
def rows_backward(grad, grad_h, saved, mean, rstd, weight, bias, center, from_y, needs):
    """Gradients of ``rows_forward``: ``(dx, dweight, dbias)`` with dweight/dbias (K,)
    fp32 (None unless asked for in ``needs``). ``saved`` is the normalized input h (or
    x), or the output y when ``from_y`` (memory-saving: ``xhat = (y - b) / w``, every
    weight element nonzero). ``grad_h``, if given, is added to dx (the gradient that
    reaches ``h = x + residual`` directly: dx is then the gradient of x and of the
    residual alike). dweight and dbias: each program's partial
    sums in one (2, P, K) buffer, P the programs that fit the device at once, summed over
    P by one reduction."""
    m, k = saved.shape
    saved, grad = saved.contiguous(), grad.contiguous()
    if grad_h is not None:
        grad_h = grad_h.contiguous()
    w, b = _flat(weight, k), _flat(bias, k)
    dx = torch.empty_like(saved)
    block, single = _row_block(k)
    rows_per_prog = _cdiv(m, min(m, _sms(saved.device) * _bwd_programs_per_sm(block)))
    programs = _cdiv(m, rows_per_prog)
    part = torch.empty((2, programs, k), dtype=torch.float32, device=saved.device)  # 2, P, K
    flags = dict(HAS_W=w is not None, HAS_B=b is not None, FROM_Y=bool(from_y),
                 BLOCK=block, STAGES=STAGES, num_warps=_warps(block))
    kern = _k()
    kern._rows_bwd_kernel[(programs,)](
        grad, saved, saved if grad_h is None else grad_h, saved if w is None else w,
        saved if b is None else b, rstd if mean is None else mean, rstd, dx, part[0], part[1],
        m, k, rows_per_prog, k, k, k, k, HAS_GH=grad_h is not None, CENTER=bool(center),
        SINGLE=single, **flags)
    if not single and (needs[1] or needs[2]):
        kern._rows_param_kernel[(programs, _cdiv(k, block))](
            grad, saved, saved if w is None else w, saved if b is None else b,
            rstd if mean is None else mean, rstd, part[0], part[1], m, k, rows_per_prog, k, k,
            **flags)
    sums = part.sum(1) if needs[1] or needs[2] else None          # second stage: 2, K
    dw, db = (None if sums is None else sums[0]), (None if sums is None else sums[1])
    return (dx if needs[0] else None), (dw if needs[1] else None), (db if needs[2] else None)


def add_one_pass(x) -> bool:
    """The residual-add norms run in one kernel each way on every input this backend
    takes (``normkit.ops.add_norm``)."""
    return True


def fused_add_forward(x, residual, weight, bias, eps, center):
    """``(y, h, mean, rstd)``: ``h = x + residual`` and its LayerNorm/RMSNorm, one pass."""
    y, h, mean, rstd, _ = rows_forward(x, residual, weight, bias, eps, center)
    return y, h, mean, rstd


fused_add_backward = rows_backward


# -- per (n, c): Batch / Instance / GroupNorm over (N, C, S) -----------------------------

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


def _groups(grouping, c):
    """``(groups, channels per group)``: Batch/InstanceNorm have one group per channel."""
    g = grouping.view[1] if grouping.kind == "group" else c
    return g, c // g


def _stat_tile(groups, partials):
    """(BLOCK_T, BLOCK_G) of the statistics kernels: up to STAT_BLOCK_MAX groups side by
    side, and as many of each group's ``partials`` (samples x parts x channels of the
    group) as fill a tile of STAT_TILE_MAX elements."""
    block_g = min(_pow2(groups), STAT_BLOCK_MAX)
    return max(1, min(_pow2(partials), STAT_TILE_MAX // block_g)), block_g


def _act_args(act):
    """``(ACT, slope)`` of the kernels for a ``normkit.activation.Activation`` or None."""
    return (0, 0.0) if act is None else (act.code, float(act.slope))


def _launch_affine(x3, g3, out3, grouping, stats, weight, bias, c_var_mean, tiles,
                   fixed=False, act=None):
    """``_nc_affine_kernel`` over the (N, C, S) views; ``stats = (mean, mean_lo, rstd)``
    flat per (sample or 1, group), ``mean_lo`` may be None; ``act``: the activation (the
    backward's ``bias`` then is the forward's, to recompute z)."""
    n, c, s = x3.shape
    block_c, block_s, parts, spp = tiles
    mean, mean_lo, rstd = stats
    groups, cg = _groups(grouping, c)
    g = x3 if g3 is None else g3
    cv, cm = (rstd, rstd) if c_var_mean is None else c_var_mean
    code, slope = _act_args(act)
    _k()._nc_affine_kernel[(n, _cdiv(c, block_c), parts)](
        x3, g, out3, mean, rstd if mean_lo is None else mean_lo, rstd, cv, cm,
        rstd if weight is None else weight, rstd if bias is None else bias, c, s, cg,
        0 if rstd.numel() == groups else groups, spp, *x3.stride(), *g.stride(), *out3.stride(),
        slope, HAS_G=g3 is not None, FIXED=bool(fixed), HAS_LO=mean_lo is not None,
        HAS_W=weight is not None, HAS_B=bias is not None, ACT=code, BLOCK_C=block_c,
        BLOCK_S=block_s, STAGES=STAGES, num_warps=_warps(block_c * block_s))


@_device_guard
def _nc_forward(x, grouping, weight, bias, eps, mean, rstd, act=None):
    x3 = _merge_batch(_ncs(x, grouping), grouping)
    n, c, s = x3.shape
    dev = x.device
    tiles = _tiles(x3)
    block_c, block_s, parts, spp = tiles
    groups, cg = _groups(grouping, c)
    var = mean_lo = None
    if mean is None:
        pmean = torch.empty((n, parts, c), dtype=torch.float64, device=dev)   # N, P, C
        pm2 = torch.empty((n, parts, c), dtype=torch.float32, device=dev)
        _k()._nc_moments_kernel[(n, _cdiv(c, block_c), parts)](
            x3, pmean, pm2, c, s, spp, *x3.stride(), BLOCK_C=block_c, BLOCK_S=block_s,
            LANES=LANES, STAGES=STAGES, X0_MEAN=X0_MEAN, num_warps=_warps(block_c * block_s))
        per = n if grouping.kind == "batch" else 1   # samples per statistic
        mean, mean_lo, var, rstd = torch.empty((4, n // per * groups), dtype=torch.float32,
                                               device=dev)            # 4 x (A * G)
        block_t, block_g = _stat_tile(groups, per * parts * cg)
        _k()._nc_stats_kernel[(n // per, _cdiv(groups, block_g))](
            pmean, pm2, mean, mean_lo, var, rstd, per, parts, c, groups, cg, s, spp,
            float(eps), BLOCK_T=block_t, BLOCK_G=block_g)
    else:
        mean, rstd = mean.reshape(-1).contiguous(), rstd.reshape(-1).contiguous()
    # the output in x's shape and layout, seen as (N, C, S) by the kernel: an output that
    # is itself a view could not be modified in place by the caller (autograd refuses)
    y = torch.empty_like(x)
    _launch_affine(x3, None, _merge_batch(_ncs(y, grouping), grouping), grouping,
                   (mean, mean_lo, rstd), _flat(weight, c), _flat(bias, c), None, tiles,
                   act=act)
    shape = grouping.stat_shape
    if var is not None:
        mean, rstd, var = mean.view(shape), rstd.view(shape), var.view(shape)
    return y, mean, rstd, var


@_device_guard
def _nc_backward(grad, x, mean, rstd, weight, grouping, center, fixed, needs, act=None,
                 bias=None):
    x3 = _ncs(x, grouping)
    g3 = _ncs(grad, grouping)
    if g3 is None:                               # strides that do not view as (N, C, S)
        g3 = grad.reshape(x3.shape)
    xm, gm = _merge_batch(x3, grouping), _merge_batch(g3, grouping)
    merged = xm.shape == gm.shape                # both, or neither, merge N and S
    if merged:
        x3, g3 = xm, gm
    n, c, s = x3.shape
    dev = x.device
    tiles = _tiles(x3)
    block_c, block_s, parts, spp = tiles
    mean, rstd = mean.reshape(-1).contiguous(), rstd.reshape(-1).contiguous()
    groups, cg = _groups(grouping, c)
    psg = torch.empty((2, n, parts, c), dtype=torch.float32, device=dev)    # 2 x (N, P, C)
    w = _flat(weight, c)
    b = None if act is None else _flat(bias, c)      # z = w * xhat + b, for act'(z) alone
    code, slope = _act_args(act)
    _k()._nc_grad_sums_kernel[(n, _cdiv(c, block_c), parts)](
        g3, x3, mean, rstd, rstd if w is None else w, rstd if b is None else b, psg[0], psg[1],
        c, s, cg, 0 if rstd.numel() == groups else groups, spp, *g3.stride(), *x3.stride(),
        slope, HAS_W=w is not None, HAS_B=b is not None, ACT=code, BLOCK_C=block_c,
        BLOCK_S=block_s, LANES=LANES, STAGES=STAGES, num_warps=_warps(block_c * block_s))
    dx = None
    if needs[0]:
        c_var_mean = None
        if not fixed:
            per = n if grouping.kind == "batch" else 1   # samples per statistic
            c_var_mean = torch.empty((2, n // per * groups), dtype=torch.float32, device=dev)
            block_t, block_g = _stat_tile(groups, per * parts * cg)
            _k()._nc_grad_stats_kernel[(n // per, _cdiv(groups, block_g))](
                psg[0], psg[1], rstd if w is None else w, c_var_mean[0], c_var_mean[1], per,
                parts, c, groups, cg, s, HAS_W=w is not None, CENTER=bool(center),
                BLOCK_T=block_t, BLOCK_G=block_g)
        dx = torch.empty_like(x)                 # x's strides: viewed as x3 is
        dx3 = _merge_batch(_ncs(dx, grouping), grouping) if merged else _ncs(dx, grouping)
        _launch_affine(x3, g3, dx3, grouping, (mean, None, rstd), w, b, c_var_mean, tiles,
                       fixed=fixed, act=act)
    pshape = grouping.param_view
    sums = psg.sum((1, 2)) if needs[1] or needs[2] else None      # second stage: 2 x C
    dw = sums[1].view(pshape) if needs[1] else None
    db = sums[0].view(pshape) if needs[2] else None
    return dx, dw, db


# -- the backend interface ---------------------------------------------------------------

def supports_activation(x, grouping, act) -> bool:
    """BatchNorm followed by ``act`` (``normkit.activation``) runs fused in the ``_nc_*``
    kernels, any layout: the activation in the store of y, its derivative in the
    backward's sums and dx."""
    return grouping.kind == "batch"


def forward(x, grouping, weight, bias, eps, center=True, mean=None, rstd=None, act=None):
    if grouping.kind != "layer":
        return _nc_forward(x, grouping, weight, bias, eps, mean, rstd, act)
    y, _, mean, rstd, var = rows_forward(x, None, weight, bias, eps, center)   # x's shape
    shape = grouping.stat_shape
    return y, mean.view(shape), rstd.view(shape), var.view(shape)


def backward(grad, x, mean, rstd, weight, grouping, center, fixed, needs, act=None,
             bias=None):
    if grouping.kind != "layer":
        return _nc_backward(grad, x, mean, rstd, weight, grouping, center, fixed, needs, act,
                            bias)
    m, k = grouping.view
    dx, dw, db = rows_backward(grad, None, x, mean.reshape(m).float(), rstd.reshape(m).float(),
                               weight, None, center, False, needs)
    pshape = grouping.param_view
    return dx, (None if dw is None else dw.view(pshape)), (None if db is None else db.view(pshape))


__all__ = ["supports", "supports_activation", "forward", "backward", "add_one_pass",
           "fused_add_forward",
           "fused_add_backward",
           "rows_forward", "rows_backward"]
