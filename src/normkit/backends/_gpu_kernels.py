"""Triton kernels of the GPU backend; imported by ``normkit.backends.gpu`` on first use.

``_rows_*`` LayerNorm / RMSNorm over the rows of an (M, K) view (last dim contiguous),
optionally adding a residual first; ``_nc_*`` Batch/Instance/GroupNorm over an (N, C, S)
view with any strides, per-(n, c) partials over tiles of (channels x positions), as the
CPU backend's ``normkit.backends.cpu.channels_last``, BatchNorm optionally followed by an
activation in its store (``_act``; its derivative in the backward's sums and dx). fp32
statistics, one cast of each output; every kernel loops over blocks of its row or tile,
so any size works. The math and its derivation: ``normkit.reference``; launchers and
block sizes: ``backends.gpu``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _chan_merge(count, mean, m2, n_new, mean_new, m2_new):
    """Chan's merge of (count, mean, M2) with a block of ``n_new`` elements of mean
    ``mean_new`` and M2 ``m2_new`` (``delta = mean_new - mean``, ``M2 += M2_new + delta^2 *
    count * n_new / (count + n_new)``); scalars or per-channel vectors alike."""
    delta = mean_new - mean
    mean = mean + delta * (n_new / (count + n_new))
    m2 = m2 + m2_new + delta * delta * (count * n_new / (count + n_new))
    return count + n_new, mean, m2


@triton.jit
def _act(z, ACT: tl.constexpr, slope):
    """``act(z)`` for the code ACT of ``normkit.activation.CODES`` (0: none, 1 relu, 2 relu6,
    3 leaky_relu, 4 silu), as torch's kernels and the CPU stores compute it: selects, so
    NaN and -0.0 pass relu's clamp; silu ``z / (1 + exp(-z))``."""
    if ACT == 1:
        z = tl.where(z < 0.0, 0.0, z)
    if ACT == 2:
        z = tl.where(z < 0.0, 0.0, z)
        z = tl.where(z > 6.0, 6.0, z)
    if ACT == 3:
        z = tl.where(z < 0.0, z * slope, z)
    if ACT == 4:
        z = z / (1.0 + tl.exp(-z))
    return z


@triton.jit
def _act_grad(g, z, ACT: tl.constexpr, slope):
    """``g * act'(z)``, at the kinks as torch's backward takes them (relu: 0 at z <= 0;
    relu6: 0 at z <= 0 and z >= 6; leaky_relu: ``g * slope`` at z <= 0; silu:
    ``g * s * (1 + z * (1 - s))``, s = sigmoid(z))."""
    if ACT == 1:
        g = tl.where(z > 0.0, g, 0.0)
    if ACT == 2:
        g = tl.where((z > 0.0) & (z < 6.0), g, 0.0)
    if ACT == 3:
        g = tl.where(z > 0.0, g, g * slope)
    if ACT == 4:
        s = 1.0 / (1.0 + tl.exp(-z))
        g = g * (s * (1.0 + z * (1.0 - s)))
    return g


# -- rows: LayerNorm / RMSNorm (+ residual) ----------------------------------------------

@triton.jit
def _load_row(X, R, H, offs, mask, HAS_RES: tl.constexpr, STORE_H: tl.constexpr):
    """One block of the row to normalize, in fp32. With a residual it is ``h = x + r``
    rounded to the storage dtype (what ``F.layer_norm(x + r)`` sees), stored once to H
    when ``STORE_H``."""
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        h = (x + tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)).to(H.dtype.element_ty)
        if STORE_H:
            tl.store(H + offs, h, mask=mask)
        x = h.to(tl.float32)
    return x


@triton.jit
def _rows_fwd_kernel(X, R, H, Y, W, B, Mean, Rstd, Var, M, K, stride_row, eps,
                     HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                     CENTER: tl.constexpr, SINGLE: tl.constexpr, BLOCK: tl.constexpr,
                     ROWS: tl.constexpr, X0_MEAN: tl.constexpr):
    """``ROWS`` rows per program: ``y = (h - mean) * rstd * w + b``, ``h = x (+ r)``.

    Statistics: each block's mean and M2 by a two-pass in registers, merged into the
    row's by Chan's rule (``_chan_merge``), so the row is read once for them and once for
    the output -- never E[x^2] - E[x]^2. Without centering (RMSNorm) mean = 0 and
    var = mean(x^2). X, R, H, Y share ``stride_row``; Mean, Rstd, Var: (M,) fp32.
    """
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)   # ROWS
    rmask = rows < M
    base = (rows * stride_row)[:, None]                            # ROWS, 1
    cols = tl.arange(0, BLOCK)[None, :]                            # 1, BLOCK
    # statistics of h - x0, x0 near the row's values: exact differences for data far from
    # 0 with a small spread (RMSNorm: no shift). ``X0_MEAN``: x0 the mean of a first pass
    # (over the row when it is one block, else over its first block), which no single
    # element can pull away from the rest; else the row's first element, one load
    x0 = tl.zeros([ROWS, 1], dtype=tl.float32)
    if CENTER and not X0_MEAN:
        x0 = _load_row(X, R, H, base, rmask[:, None], HAS_RES, False)
    if CENTER and X0_MEAN and not SINGLE:                          # (ROWS = 1, K > BLOCK)
        first = _load_row(X, R, H, base + cols, rmask[:, None], HAS_RES, False)
        x0 = (tl.sum(first, axis=1) / BLOCK)[:, None]
    if SINGLE:                                                     # the row is one block
        mask = rmask[:, None] & (cols < K)                         # ROWS, BLOCK
        d = tl.where(mask, _load_row(X, R, H, base + cols, mask, HAS_RES, True), 0.0)
        mean = tl.zeros([ROWS], dtype=tl.float32)
        if CENTER:
            if X0_MEAN:
                x0 = (tl.sum(d, axis=1) / K)[:, None]
            d = tl.where(mask, d - x0, 0.0)
            mean = tl.sum(d, axis=1) / K                           # mean - x0; ROWS
            d = tl.where(mask, d - mean[:, None], 0.0)
        var = tl.sum(d * d, axis=1) / K                            # ROWS
        rstd = tl.math.rsqrt(var + eps)
        y = d * rstd[:, None]
        if HAS_W:
            y = y * tl.load(W + cols, mask=cols < K, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(B + cols, mask=cols < K, other=0.0).to(tl.float32)
        tl.store(Y + base + cols, y.to(Y.dtype.element_ty), mask=mask)
    else:                                                          # ROWS = 1: blocks of a row
        mean = tl.zeros([ROWS], dtype=tl.float32)                  # running Chan merge
        m2 = tl.zeros([ROWS], dtype=tl.float32)
        cnt = 0.0                                                  # elements merged so far
        for k0 in range(0, K, BLOCK):
            mask = rmask[:, None] & (k0 + cols < K)
            x = tl.where(mask, _load_row(X, R, H, base + k0 + cols, mask, HAS_RES, True) - x0,
                         0.0)                                      # ROWS, BLOCK
            nb = tl.minimum(K - k0, BLOCK).to(tl.float32)         # elements in the block
            if CENTER:
                bmean = tl.sum(x, axis=1) / nb
                d = tl.where(mask, x - bmean[:, None], 0.0)
                cnt, mean, m2 = _chan_merge(cnt, mean, m2, nb, bmean, tl.sum(d * d, axis=1))
            else:
                m2 = m2 + tl.sum(x * x, axis=1)
        var = m2 / K
        rstd = tl.math.rsqrt(var + eps)
        for k0 in range(0, K, BLOCK):                              # second read: output
            cm = k0 + cols < K
            x = _load_row(X, R, H, base + k0 + cols, rmask[:, None] & cm, HAS_RES, False)
            y = ((x - x0) - mean[:, None]) * rstd[:, None]
            if HAS_W:
                y = y * tl.load(W + k0 + cols, mask=cm, other=0.0).to(tl.float32)
            if HAS_B:
                y = y + tl.load(B + k0 + cols, mask=cm, other=0.0).to(tl.float32)
            tl.store(Y + base + k0 + cols, y.to(Y.dtype.element_ty), mask=rmask[:, None] & cm)
    tl.store(Mean + rows, mean + tl.sum(x0, axis=1), mask=rmask)
    tl.store(Rstd + rows, rstd, mask=rmask)
    tl.store(Var + rows, var, mask=rmask)


@triton.jit
def _xhat(S, W, B, offs, mask, mean, rstd, FROM_Y: tl.constexpr, HAS_W: tl.constexpr,
          HAS_B: tl.constexpr):
    """The normalized input of a block, recomputed: ``(x - mean) * rstd`` from the saved
    input, or ``(y - b) / w`` from the saved output (memory-saving backward)."""
    s = tl.load(S + offs, mask=mask, other=0.0).to(tl.float32)
    if FROM_Y:
        if HAS_B:
            s = s - tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            s = s / tl.load(W + offs, mask=mask, other=1.0).to(tl.float32)
    else:
        s = tl.where(mask, (s - mean) * rstd, 0.0)
    return s


@triton.jit
def _dxhat_xhat(G, S, W, B, offs, mask, mean, rstd, FROM_Y: tl.constexpr, HAS_W: tl.constexpr,
                HAS_B: tl.constexpr):
    """One block of a row (G, S point at the row): ``dxhat = g * w`` and ``xhat``."""
    xh = _xhat(S, W, B, offs, mask, mean, rstd, FROM_Y, HAS_W, HAS_B)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_W:
        g = g * tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    return g, xh


@triton.jit
def _rows_bwd_kernel(G, S, GH, W, B, Mean, Rstd, DX, DWp, DBp, M, K, rows_per_prog,
                     stride_g, stride_s, stride_gh, stride_dx,
                     HAS_GH: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                     CENTER: tl.constexpr, FROM_Y: tl.constexpr, SINGLE: tl.constexpr,
                     BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """dx of rows ``[pid * rows_per_prog, ...)``; with ``SINGLE`` also this program's
    partial ``dw = sum(g * xhat)`` and ``db = sum(g)`` into row ``pid`` of DWp, DBp.

    With ``dxhat = g * w``, ``c_var = mean(dxhat * xhat)`` and ``c_mean = mean(dxhat)``
    over the row (``c_mean = 0`` without centering)::

        dx = rstd * (dxhat - c_mean - xhat * c_var)   (+ gh: the gradient reaching h)

    S is the saved input (``FROM_Y = False``) or output (``FROM_Y``, then xhat =
    (y - b) / w, the precondition w != 0 checked by the caller).
    """
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    row0 = pid.to(tl.int64) * rows_per_prog                       # 64-bit offsets
    row1 = tl.minimum(row0 + rows_per_prog, M)
    if SINGLE:
        mask = cols < K
        if HAS_W:
            w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)     # BLOCK
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        db = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.range(row0, row1, num_stages=STAGES):      # next rows' loads in flight
            mean = tl.load(Mean + r)
            rstd = tl.load(Rstd + r)
            g = tl.load(G + r * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
            xh = _xhat(S + r * stride_s, W, B, cols, mask, mean, rstd, FROM_Y, HAS_W, HAS_B)
            dxh = g                                                # BLOCK
            if HAS_W:
                dxh = g * w
            c_var = tl.sum(dxh * xh, axis=0) / K                   # variance path
            if CENTER:
                c_mean = tl.sum(dxh, axis=0) / K                   # mean path
            else:
                c_mean = 0.0
            dx = (dxh - c_mean - xh * c_var) * rstd
            if HAS_GH:
                dx = dx + tl.load(GH + r * stride_gh + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + r * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
            dw += g * xh
            db += g
        tl.store(DWp + pid * K + cols, dw, mask=mask)
        tl.store(DBp + pid * K + cols, db, mask=mask)
    else:                                                          # dw, db: _rows_param_kernel
        for r in range(row0, row1):
            mean = tl.load(Mean + r)
            rstd = tl.load(Rstd + r)
            c_var = 0.0
            c_mean = 0.0
            for k0 in range(0, K, BLOCK):
                offs = k0 + cols
                mask = offs < K
                g, xh = _dxhat_xhat(G + r * stride_g, S + r * stride_s, W, B, offs, mask,
                                    mean, rstd, FROM_Y, HAS_W, HAS_B)
                c_var += tl.sum(g * xh, axis=0)
                c_mean += tl.sum(g, axis=0)
            c_var = c_var / K
            if CENTER:
                c_mean = c_mean / K
            else:
                c_mean = 0.0
            for k0 in range(0, K, BLOCK):                          # the row again, from L2
                offs = k0 + cols
                mask = offs < K
                g, xh = _dxhat_xhat(G + r * stride_g, S + r * stride_s, W, B, offs, mask,
                                    mean, rstd, FROM_Y, HAS_W, HAS_B)
                dx = (g - c_mean - xh * c_var) * rstd
                if HAS_GH:
                    dx = dx + tl.load(GH + r * stride_gh + offs, mask=mask,
                                      other=0.0).to(tl.float32)
                tl.store(DX + r * stride_dx + offs, dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _rows_param_kernel(G, S, W, B, Mean, Rstd, DWp, DBp, M, K, rows_per_prog,
                       stride_g, stride_s, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                       FROM_Y: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Partial ``dw = sum(g * xhat)``, ``db = sum(g)`` of one column block over one chunk
    of rows (program (p, j) writes row p, block j of DWp, DBp): the first of the two
    reduction stages when a row does not fit one block."""
    pid = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < K
    row0 = pid.to(tl.int64) * rows_per_prog                       # 64-bit offsets
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.range(row0, tl.minimum(row0 + rows_per_prog, M), num_stages=STAGES):
        g = tl.load(G + r * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
        xh = _xhat(S + r * stride_s, W, B, offs, mask, tl.load(Mean + r), tl.load(Rstd + r),
                   FROM_Y, HAS_W, HAS_B)
        dw += g * xh
        db += g
    tl.store(DWp + pid * K + offs, dw, mask=mask)
    tl.store(DBp + pid * K + offs, db, mask=mask)


# -- per (n, c): Batch/Instance/GroupNorm over an (N, C, S) view with any strides --------

@triton.jit
def _nc_moments_kernel(X, PMean, PM2, C, S, s_per_part, sxn, sxc, sxs,
                       BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, LANES: tl.constexpr,
                       STAGES: tl.constexpr, X0_MEAN: tl.constexpr):
    """Per-(n, c) mean and M2 over one range of positions: program (n, cb, p) covers the
    channels ``[cb * BLOCK_C, ...)`` and positions ``[p * s_per_part, ...)`` of sample n,
    in (BLOCK_C x BLOCK_S) tiles. ``LANES``: each element of the tile keeps its own
    count, mean and M2 (Welford, ``mean += d / n``, ``M2 += d * (x - mean)``), merged
    over the tile's positions once after the loop (Chan); else a two-pass per tile,
    Chan-merged across tiles. Writes PMean[n, p, c] (fp64), PM2[n, p, c] (fp32), (N, P,
    C); the merge of the parts into each group's statistics is the launcher's second stage."""
    n = tl.program_id(0).to(tl.int64)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)      # BLOCK_C
    p = tl.program_id(2)
    cmask = cs < C
    s0 = p * s_per_part
    s1 = tl.minimum(s0 + s_per_part, S)
    mean = tl.zeros([BLOCK_C], dtype=tl.float32)                   # mean - x0
    m2 = tl.zeros([BLOCK_C], dtype=tl.float32)
    cnt = 0.0                                                      # positions merged so far
    lanes = tl.zeros([BLOCK_C, BLOCK_S], dtype=tl.float32)         # per element: count,
    lmean = tl.zeros([BLOCK_C, BLOCK_S], dtype=tl.float32)         # mean - x0, M2
    lm2 = tl.zeros([BLOCK_C, BLOCK_S], dtype=tl.float32)
    base = X + n * sxn + cs[:, None].to(tl.int64) * sxc
    # moments of x - x0, x0 per channel near its values in the part (see the rows kernel):
    # ``X0_MEAN``, the mean of its first tile of positions; else its first value
    if X0_MEAN:
        ss = s0 + tl.arange(0, BLOCK_S)
        mask = cmask[:, None] & (ss < s1)[None, :]
        first = tl.load(base + ss[None, :].to(tl.int64) * sxs, mask=mask, other=0.0)
        x0 = tl.sum(first.to(tl.float32), axis=1) / tl.maximum(tl.minimum(s1 - s0, BLOCK_S), 1)
    else:
        x0 = tl.load(X + n * sxn + cs.to(tl.int64) * sxc + s0.to(tl.int64) * sxs, mask=cmask,
                     other=0.0).to(tl.float32)                     # BLOCK_C
    for sb in tl.range(s0, s1, BLOCK_S, num_stages=STAGES):
        ss = sb + tl.arange(0, BLOCK_S)                            # BLOCK_S
        mask = cmask[:, None] & (ss < s1)[None, :]                 # BLOCK_C, BLOCK_S
        x = tl.load(base + ss[None, :].to(tl.int64) * sxs, mask=mask, other=0.0).to(tl.float32)
        x = tl.where(mask, x - x0[:, None], 0.0)                   # BLOCK_C, BLOCK_S
        if LANES:
            lanes += mask.to(tl.float32)
            d = tl.where(mask, x - lmean, 0.0)
            lmean += d / tl.maximum(lanes, 1.0)
            lm2 += d * (x - lmean)
        else:
            nb = tl.minimum(s1 - sb, BLOCK_S).to(tl.float32)
            bmean = tl.sum(x, axis=1) / nb                         # BLOCK_C
            d = tl.where(mask, x - bmean[:, None], 0.0)
            cnt, mean, m2 = _chan_merge(cnt, mean, m2, nb, bmean, tl.sum(d * d, axis=1))
    if LANES:                                                      # Chan over the lanes
        mean = tl.sum(lanes * lmean, axis=1) / tl.maximum(tl.sum(lanes, axis=1), 1.0)
        d = lmean - mean[:, None]
        m2 = tl.sum(lm2 + lanes * d * d, axis=1)
    out = (n * tl.num_programs(2) + p) * C + cs
    tl.store(PMean + out, x0.to(tl.float64) + mean.to(tl.float64), mask=cmask)
    tl.store(PM2 + out, m2, mask=cmask)


@triton.jit
def _partial_rows(t, n0, P, C, CG, s_per_part, S):
    """Offsets (without the group's channel base) and position counts of the flat
    reduction index ``t`` over (sample, part, channel of the group): ``t = ((n - n0) * P
    + p) * CG + j`` -> ``(n * P + p) * C + j`` and the part's count of positions."""
    j = t % CG
    p = (t // CG) % P
    n = n0 + t // (CG * P)
    cnt = tl.minimum(tl.maximum(S - p * s_per_part, 0), s_per_part).to(tl.float64)
    return (n.to(tl.int64) * P + p) * C + j, cnt


@triton.jit(do_not_specialize=["N_PER"])   # a tensor even when 1 (N_PER.to)
def _nc_stats_kernel(PMean, PM2, Mean, MeanLo, Var, Rstd, N_PER, P, C, G, CG, S, s_per_part,
                     eps, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr):
    """The grouping's statistics from the (N, P, C) partials of ``_nc_moments_kernel``, in
    float64: program (a, gb) merges, for the groups ``[gb * BLOCK_G, ...)`` of ``CG``
    channels, the partials of samples ``[a * N_PER, ...)`` (BatchNorm: N_PER = N, one
    program row; Instance/GroupNorm: N_PER = 1) over every part::

        mean = sum(n_i mean_i) / n,   M2 = sum(M2_i + n_i (mean_i - mean)^2)

    ``n_i`` is the part's count of positions. The partials of a group -- samples x parts
    x its channels, ``T = N_PER * P * CG`` of them -- are read BLOCK_T at a time in
    (BLOCK_T x BLOCK_G) tiles and summed along T, so no count of samples (BatchNorm) or
    channels (GroupNorm(1, C)) becomes a long serial loop. Writes (A, G) fp32: the mean as
    hi (``Mean``) + lo (``MeanLo``), the variance and ``rstd = 1 / sqrt(var + eps)``."""
    a = tl.program_id(0)
    gs = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)      # BLOCK_G
    gmask = gs < G
    n0 = a * N_PER
    t_end = N_PER * P * CG
    total = N_PER.to(tl.float64) * S * CG
    acc = tl.zeros([BLOCK_G], dtype=tl.float64)
    for t0 in range(0, t_end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)                             # BLOCK_T
        rows, cnt = _partial_rows(t, n0, P, C, CG, s_per_part, S)
        offs = rows[:, None] + (gs * CG)[None, :]                  # BLOCK_T, BLOCK_G
        mask = (t < t_end)[:, None] & gmask[None, :]
        pm = tl.load(PMean + offs, mask=mask, other=0.0)
        acc += tl.sum(cnt[:, None] * pm, axis=0)
    mean = acc / total
    m2 = tl.zeros([BLOCK_G], dtype=tl.float64)
    for t0 in range(0, t_end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        rows, cnt = _partial_rows(t, n0, P, C, CG, s_per_part, S)
        offs = rows[:, None] + (gs * CG)[None, :]
        mask = (t < t_end)[:, None] & gmask[None, :]
        d = tl.where(mask, tl.load(PMean + offs, mask=mask, other=0.0) - mean[None, :], 0.0)
        q = tl.load(PM2 + offs, mask=mask, other=0.0).to(tl.float64) + cnt[:, None] * d * d
        m2 += tl.sum(q, axis=0)
    var = m2 / total
    hi = mean.to(tl.float32)
    out = a * G + gs
    tl.store(Mean + out, hi, mask=gmask)
    tl.store(MeanLo + out, (mean - hi.to(tl.float64)).to(tl.float32), mask=gmask)
    tl.store(Var + out, var.to(tl.float32), mask=gmask)
    tl.store(Rstd + out, (1.0 / tl.sqrt(var + eps)).to(tl.float32), mask=gmask)


@triton.jit
def _pre_act(W, B, cs, cmask, rs, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """The forward's per-channel coefficients of ``z = (x - mu) * zs + zb``: ``zs = rstd *
    w``, ``zb = b`` (BLOCK_C, 1), from which the backward of an activation recomputes z."""
    zs = rs
    if HAS_W:
        zs = rs * tl.load(W + cs, mask=cmask, other=0.0).to(tl.float32)
    zb = tl.zeros_like(rs)
    if HAS_B:
        zb = tl.load(B + cs, mask=cmask, other=0.0).to(tl.float32)
    return zs[:, None], zb[:, None]


@triton.jit
def _nc_grad_sums_kernel(G, X, Mean, Rstd, W, B, PSg, PSgx, C, S, CG, stat_sn, s_per_part,
                         sgn, sgc, sgs, sxn, sxc, sxs, slope, HAS_W: tl.constexpr,
                         HAS_B: tl.constexpr, ACT: tl.constexpr, BLOCK_C: tl.constexpr,
                         BLOCK_S: tl.constexpr, LANES: tl.constexpr, STAGES: tl.constexpr):
    """Per-(n, c) partial sums of ``g`` and ``g * xhat`` over one range of positions (the
    tiling of ``_nc_moments_kernel``, ``LANES``: summed per element, reduced after the
    loop); Mean, Rstd: the statistics of each (sample, group), read as in
    ``_nc_affine_kernel``. These are dbias and dweight before the sums over parts and
    samples, and the terms of the group sums c_var, c_mean. With an activation (``ACT``)
    ``g`` is ``g * act'(z)``, ``z = (x - mu) * rstd * w + b`` recomputed as the affine
    kernel's backward recomputes it (W, B are read for that alone)."""
    n = tl.program_id(0).to(tl.int64)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    p = tl.program_id(2)
    cmask = cs < C
    s0 = p * s_per_part
    s1 = tl.minimum(s0 + s_per_part, S)
    st = n * stat_sn + cs // CG
    mu = tl.load(Mean + st, mask=cmask, other=0.0).to(tl.float32)  # BLOCK_C
    rs = tl.load(Rstd + st, mask=cmask, other=0.0).to(tl.float32)
    zs, zb = _pre_act(W, B, cs, cmask, rs, HAS_W, HAS_B)           # BLOCK_C, 1
    sg = tl.zeros([BLOCK_C], dtype=tl.float32)
    sgx = tl.zeros([BLOCK_C], dtype=tl.float32)
    lg = tl.zeros([BLOCK_C, BLOCK_S], dtype=tl.float32)
    lgx = tl.zeros([BLOCK_C, BLOCK_S], dtype=tl.float32)
    c64 = cs[:, None].to(tl.int64)
    for sb in tl.range(s0, s1, BLOCK_S, num_stages=STAGES):
        ss = (sb + tl.arange(0, BLOCK_S))[None, :]
        mask = cmask[:, None] & (ss < s1)
        s64 = ss.to(tl.int64)
        g = tl.load(G + n * sgn + c64 * sgc + s64 * sgs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + n * sxn + c64 * sxc + s64 * sxs, mask=mask, other=0.0).to(tl.float32)
        xh = (x - mu[:, None]) * rs[:, None]                       # BLOCK_C, BLOCK_S
        if ACT != 0:
            g = _act_grad(g, (x - mu[:, None]) * zs + zb, ACT, slope)
        if LANES:
            lg += g
            lgx += g * xh
        else:
            sg += tl.sum(g, axis=1)
            sgx += tl.sum(g * xh, axis=1)
    if LANES:
        sg, sgx = tl.sum(lg, axis=1), tl.sum(lgx, axis=1)
    out = (n * tl.num_programs(2) + p) * C + cs
    tl.store(PSg + out, sg, mask=cmask)
    tl.store(PSgx + out, sgx, mask=cmask)


@triton.jit(do_not_specialize=["N_PER"])   # a tensor even when 1 (N_PER.to)
def _nc_grad_stats_kernel(PSg, PSgx, W, CVar, CMean, N_PER, P, C, G, CG, S,
                          HAS_W: tl.constexpr, CENTER: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_G: tl.constexpr):
    """The group sums of the input gradient from the (N, P, C) partials of
    ``_nc_grad_sums_kernel``, in float64, over the tiles of ``_nc_stats_kernel``::

        c_var = sum(w * g * xhat) / n,   c_mean = sum(w * g) / n   (0 without centering)

    Writes (A, G) fp32."""
    a = tl.program_id(0)
    gs = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    gmask = gs < G
    n0 = a * N_PER
    t_end = N_PER * P * CG
    sv = tl.zeros([BLOCK_G], dtype=tl.float64)
    sm = tl.zeros([BLOCK_G], dtype=tl.float64)
    for t0 in range(0, t_end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        rows, _ = _partial_rows(t, n0, P, C, CG, 1, 1)
        offs = rows[:, None] + (gs * CG)[None, :]                  # BLOCK_T, BLOCK_G
        mask = (t < t_end)[:, None] & gmask[None, :]
        gx = tl.load(PSgx + offs, mask=mask, other=0.0).to(tl.float64)
        g = tl.load(PSg + offs, mask=mask, other=0.0).to(tl.float64)
        if HAS_W:
            w = tl.load(W + (t % CG)[:, None] + (gs * CG)[None, :], mask=mask,
                        other=0.0).to(tl.float64)
            gx = w * gx
            g = w * g
        sv += tl.sum(gx, axis=0)
        sm += tl.sum(g, axis=0)
    total = N_PER.to(tl.float64) * S * CG
    out = a * G + gs
    tl.store(CVar + out, (sv / total).to(tl.float32), mask=gmask)
    if CENTER:
        sm = sm / total
    else:
        sm = tl.zeros([BLOCK_G], dtype=tl.float64)
    tl.store(CMean + out, sm.to(tl.float32), mask=gmask)


@triton.jit
def _nc_affine_kernel(X, G, Y, Mean, MeanLo, Rstd, CVar, CMean, W, B, C, S, CG, stat_sn,
                      s_per_part, sxn, sxc, sxs, sgn, sgc, sgs, syn, syc, sys_, slope,
                      HAS_G: tl.constexpr, FIXED: tl.constexpr, HAS_LO: tl.constexpr,
                      HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
                      BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, STAGES: tl.constexpr):
    """``y = (x - mu) * a + b (+ g * scale_g)``, the coefficients made per channel from
    the statistics of its (sample, group): ``Mean``, ``Rstd`` (and ``CVar``, ``CMean``)
    at ``n * stat_sn + c // CG`` (stat_sn = 0: one statistic per group for every sample).

    Forward: ``a = rstd * w``, ``b = bias``. Backward (``HAS_G``): ``scale_g = rstd * w``,
    ``a = -rstd^2 * c_var``, ``b = -rstd * c_mean``, i.e. ``dx = rstd * (g * w - c_mean -
    xhat * c_var)``; with ``FIXED`` (statistics that are constants) ``a = b = 0``.
    With ``HAS_LO`` the mean is fp32 ``Mean + MeanLo`` (hi + lo),
    subtracted before scaling: ``(x - hi) - lo`` keeps the digits of inputs far from 0.
    With an activation (``ACT``, BatchNorm's): the forward stores ``act(y)``, the backward
    takes ``g * act'(z)`` for g, z recomputed as in ``_nc_grad_sums_kernel``."""
    n = tl.program_id(0).to(tl.int64)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    p = tl.program_id(2)
    cmask = cs < C
    s0 = p * s_per_part
    s1 = tl.minimum(s0 + s_per_part, S)
    st = n * stat_sn + cs // CG                                    # BLOCK_C
    mu = tl.load(Mean + st, mask=cmask, other=0.0).to(tl.float32)
    mu_lo = 0.0
    if HAS_LO:
        mu_lo = tl.load(MeanLo + st, mask=cmask, other=0.0)
    rs = tl.load(Rstd + st, mask=cmask, other=0.0).to(tl.float32)
    scale, zb = _pre_act(W, B, cs, cmask, rs, HAS_W, HAS_B)        # BLOCK_C, 1
    if HAS_G:
        if FIXED:
            a = tl.zeros([BLOCK_C, 1], dtype=tl.float32)
            b = tl.zeros([BLOCK_C, 1], dtype=tl.float32)
        else:
            a = (-rs * rs * tl.load(CVar + st, mask=cmask, other=0.0))[:, None]
            b = (-rs * tl.load(CMean + st, mask=cmask, other=0.0))[:, None]
    else:
        a, b = scale, zb
    mu = mu[:, None]                                               # BLOCK_C, 1
    if HAS_LO:
        mu_lo = mu_lo[:, None]
    c64 = cs[:, None].to(tl.int64)
    for sb in tl.range(s0, s1, BLOCK_S, num_stages=STAGES):
        ss = (sb + tl.arange(0, BLOCK_S))[None, :]
        mask = cmask[:, None] & (ss < s1)
        s64 = ss.to(tl.int64)
        x = tl.load(X + n * sxn + c64 * sxc + s64 * sxs, mask=mask, other=0.0).to(tl.float32)
        y = ((x - mu) - mu_lo) * a + b                             # BLOCK_C, BLOCK_S
        if HAS_G:
            g = tl.load(G + n * sgn + c64 * sgc + s64 * sgs, mask=mask, other=0.0).to(tl.float32)
            if ACT != 0:
                g = _act_grad(g, (x - mu) * scale + zb, ACT, slope)
            y = y + g * scale
        else:
            y = _act(y, ACT, slope)
        tl.store(Y + n * syn + c64 * syc + s64 * sys_, y.to(Y.dtype.element_ty), mask=mask)
