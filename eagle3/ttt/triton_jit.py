"""The Triton kernels behind eagle3/ttt/triton_kernels.py (which documents them and holds their Python
wrappers). Imports Triton: only eagle3/ttt/triton_kernels.py imports this module, when a kernel is first
used on CUDA, so core code stays importable with torch alone."""
import triton
import triton.language as tl


@triton.jit
def row_block(R, BLOCK_R: tl.constexpr, D: tl.constexpr):
    # this program's rows of a [R, D] row-major tensor: row ids, their mask, element offsets, 2-D mask
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    return rows, rmask, rows[:, None] * D + tl.arange(0, D)[None, :], rmask[:, None]


@triton.jit
def merge_forward_kernel(q_ptr, o0_ptr, lse0_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, R, S, slot, scale,
                         BLOCK_R: tl.constexpr, D: tl.constexpr):
    rows, rmask, offs, m2 = row_block(R, BLOCK_R, D)
    q = tl.load(q_ptr + offs, mask=m2, other=0.0).to(tl.float32)
    acc = tl.load(o0_ptr + offs, mask=m2, other=0.0).to(tl.float32)
    m = tl.load(lse0_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    l = tl.full([BLOCK_R], 1.0, tl.float32)
    for j in range(S):
        base = j.to(tl.int64) * slot
        k = tl.load(k_ptr + base + offs, mask=m2, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + base + offs, mask=m2, other=0.0).to(tl.float32)
        s = tl.sum(q * k, axis=1) * scale
        m_new = tl.maximum(m, s)
        a = tl.exp(m - m_new)
        b = tl.exp(s - m_new)
        acc = acc * a[:, None] + b[:, None] * v
        l = l * a + b
        m = m_new
    tl.store(out_ptr + offs, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=m2)
    tl.store(lse_ptr + rows, m + tl.log(l), mask=rmask)


@triton.jit
def merge_backward_kernel(do_ptr, q_ptr, out_ptr, lse_ptr, dq0_ptr, k_ptr, v_ptr, dq_ptr, dk_ptr, dv_ptr,
                          R, S, slot, scale, BLOCK_R: tl.constexpr, D: tl.constexpr):
    rows, rmask, offs, m2 = row_block(R, BLOCK_R, D)
    do = tl.load(do_ptr + offs, mask=m2, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + offs, mask=m2, other=0.0).to(tl.float32)
    delta = tl.sum(do * tl.load(out_ptr + offs, mask=m2, other=0.0).to(tl.float32), axis=1)
    lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    dq = tl.load(dq0_ptr + offs, mask=m2, other=0.0).to(tl.float32)
    for j in range(S):
        base = j.to(tl.int64) * slot
        k = tl.load(k_ptr + base + offs, mask=m2, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + base + offs, mask=m2, other=0.0).to(tl.float32)
        p = tl.exp(tl.sum(q * k, axis=1) * scale - lse)
        tl.store(dv_ptr + base + offs, (p[:, None] * do).to(dv_ptr.dtype.element_ty), mask=m2)
        ds = p * (tl.sum(do * v, axis=1) - delta) * scale
        dq += ds[:, None] * k
        tl.store(dk_ptr + base + offs, (ds[:, None] * q).to(dk_ptr.dtype.element_ty), mask=m2)
    tl.store(dq_ptr + offs, dq.to(dq_ptr.dtype.element_ty), mask=m2)


@triton.jit
def soft_ce_kernel(logits_ptr, teacher_ptr, rows_ptr, scale_ptr, g_ptr, loss_ptr, top_ptr, V,
                   BLOCK_V: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + r * V
    teacher_row = teacher_ptr + tl.load(rows_ptr + r).to(tl.int64) * V
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    p_sum = tl.zeros([], tl.float32)
    pl_sum = tl.zeros([], tl.float32)
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.zeros([], tl.int64)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        lf = tl.load(logits_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        p = tl.load(teacher_row + cols, mask=mask, other=0.0).to(tl.float32)
        block_max = tl.max(lf, axis=0)
        block_i = tl.argmax(lf, axis=0).to(tl.int64) + start
        best_i = tl.where(block_max > best, block_i, best_i)  # strictly greater: the first maximum wins
        best = tl.maximum(best, block_max)
        m_new = tl.maximum(m, block_max)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(lf - m_new), axis=0)
        m = m_new
        p_sum += tl.sum(p, axis=0)
        pl_sum += tl.sum(tl.where(mask, p * lf, 0.0), axis=0)
    lse = m + tl.log(s)
    scale = tl.load(scale_ptr).to(tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        lf = tl.load(logits_row + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(teacher_row + cols, mask=mask, other=0.0).to(tl.float32)
        g = (tl.exp(lf - lse) * p_sum - p) * scale
        tl.store(g_ptr + r * V + cols, g.to(g_ptr.dtype.element_ty), mask=mask)
    tl.store(loss_ptr + r, p_sum * lse - pl_sum)
    tl.store(top_ptr + r, best_i)


@triton.jit
def adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, scale_ptr, n, beta1, beta2, eps, decay, step_size, bias2_sqrt,
                 HAS_SCALE: tl.constexpr, MAXIMIZE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    if HAS_SCALE:
        g = g / tl.load(scale_ptr)
    if MAXIMIZE:
        g = -g
    p = tl.load(p_ptr + offs, mask=mask, other=0.0) * decay
    m = beta1 * tl.load(m_ptr + offs, mask=mask, other=0.0) + (1.0 - beta1) * g
    v = beta2 * tl.load(v_ptr + offs, mask=mask, other=0.0) + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) / bias2_sqrt + eps)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
