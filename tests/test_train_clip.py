"""train/distributed.clip_gradients: clipping folded into a fused AdamW step (its `grad_scale`) gives the
update of torch's clip_grad_norm_ followed by the step; other optimizers / FSDP keep accelerate's clip."""
import pytest
import torch

from train.distributed import clip_folds_into_step, clip_gradients, optimizer_step


class _Accelerator:
    """Stands in for accelerate's Accelerator.clip_grad_norm_ (records its calls)."""

    def __init__(self):
        self.calls = 0

    def clip_grad_norm_(self, params, max_norm):
        self.calls += 1
        return torch.nn.utils.clip_grad_norm_(params, max_norm)


def _params_and_grads(scale: float):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(7, generator=g))]
    grads = [scale * torch.randn(p.shape, generator=g) for p in params]
    return params, grads


@pytest.mark.parametrize("grad_scale", [10.0, 0.01])  # norm far above max_norm (clipped) / below it (untouched)
def test_clip_folded_into_fused_adamw_matches_clip_then_step(grad_scale):
    results = {}
    for fused in (True, False):
        params, grads = _params_and_grads(grad_scale)
        opt = torch.optim.AdamW(params, lr=1e-2, fused=fused) if fused else torch.optim.AdamW(params, lr=1e-2)
        acc = _Accelerator()
        for step in range(3):
            for p, g in zip(params, grads):
                p.grad = g * (step + 1)
            norm = clip_gradients(acc, opt, params, 0.5, fsdp=False)
            optimizer_step(opt)
            assert not hasattr(opt, "grad_scale")  # consumed by its own step only
            want_norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) * (step + 1) for g in grads]))
            torch.testing.assert_close(norm, want_norm)
        assert acc.calls == (0 if fused else 3)
        results[fused] = [p.detach().clone() for p in params]
    for a, b in zip(results[True], results[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    moved = max((a - b).abs().max() for a, b in zip(results[True], _params_and_grads(grad_scale)[0]))
    assert moved > 1e-3  # the steps did update
    params, grads = _params_and_grads(grad_scale)  # the same steps unclipped: Adam is nearly scale-free, but
    opt = torch.optim.AdamW(params, lr=1e-2, fused=True)  # clipping evens out the growing gradients
    for step in range(3):
        for p, g in zip(params, grads):
            p.grad = g * (step + 1)
        opt.step()
    differs = max((a - b).abs().max() for a, b in zip(results[True], params))
    assert (differs > 1e-4) == (grad_scale > 1)


def test_clip_folds_only_into_fused_adam_without_fsdp():
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert clip_folds_into_step(torch.optim.AdamW(p, fused=True), fsdp=False)
    assert not clip_folds_into_step(torch.optim.AdamW(p, fused=True), fsdp=True)
    assert not clip_folds_into_step(torch.optim.AdamW(p, foreach=False), fsdp=False)
    assert not clip_folds_into_step(torch.optim.SGD(p, lr=0.1), fsdp=False)

    class Wrapped:  # accelerate's AcceleratedOptimizer keeps the torch optimizer as .optimizer
        optimizer = torch.optim.Adam(p, fused=True)
    assert clip_folds_into_step(Wrapped(), fsdp=False)
