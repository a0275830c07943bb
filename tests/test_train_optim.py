"""train/optim.py: the Triton AdamW steps as torch's AdamW does (CUDA: the kernel against torch's fused
AdamW; everywhere: the fallback, the clip factor, state_dicts that move between the two), and
`adamw` picks the optimizer the trainer documents."""
import copy

import pytest
import torch

from eagle3.ttt import triton_kernels
from train.distributed import clip_folds_into_step, clip_gradients, optimizer_step
from train.optim import TritonAdamW, adamw

CUDA = torch.cuda.is_available() and triton_kernels.triton_available()


def params_and_grads(device, seed=0, shapes=((300, 7), (5000,), (1,))):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(*s, generator=g).to(device)) for s in shapes]
    grads = [[torch.randn(*s, generator=g).to(device) for s in shapes] for _ in range(4)]
    return ps, grads


def run_steps(opt_cls, device, scales=(None, 3.0, None, 0.5), **kw):
    """Four steps with fixed gradients; a clip factor `grad_scale` on some (as clip_gradients sets it)."""
    ps, grads = params_and_grads(device)
    opt = opt_cls(ps, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kw)
    seen = []
    for step_grads, scale in zip(grads, scales):
        for p, gr in zip(ps, step_grads):
            p.grad = gr.clone()
        if scale is not None:
            opt.grad_scale = torch.tensor(scale, device=device)
        opt.step()
        if hasattr(opt, "grad_scale"):
            del opt.grad_scale
        seen.append([p.grad.clone() for p in ps])
    return ps, opt, seen, grads


def test_fallback_matches_torch_adamw_with_the_clip_factor_applied_to_the_gradients():
    """CPU (or any tensor the kernel does not take): torch's step, the pending clip factor applied first."""
    ps, opt, seen, _ = run_steps(TritonAdamW, "cpu")
    want, ref_opt, _, _ = run_steps(torch.optim.AdamW, "cpu", fused=True)  # torch's CPU fused AdamW takes grad_scale
    for p, q in zip(ps, want):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert not torch.equal(ps[0], run_steps(TritonAdamW, "cpu", scales=(None,) * 4)[0][0])  # the factor mattered
    assert not hasattr(opt, "grad_scale")


def test_state_dicts_move_between_torch_adamw_and_triton_adamw():
    """Checkpoints: a TritonAdamW state loads into torch's AdamW and back, and the next steps agree."""
    ps, opt, _, grads = run_steps(TritonAdamW, "cpu")
    twin = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    torch_opt = torch.optim.AdamW(twin, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    torch_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    back = TritonAdamW([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=1e-2, betas=(0.9, 0.95),
                       weight_decay=0.1)
    back.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    for o, group in ((opt, ps), (torch_opt, twin), (back, back.param_groups[0]["params"])):
        for p, gr in zip(group, grads[0]):
            p.grad = gr.clone()
        o.step()
    for a, b, c in zip(ps, twin, back.param_groups[0]["params"]):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(c, b)
    assert float(opt.state[ps[0]]["step"]) == 5.0


def test_the_clip_folds_into_triton_adamw_and_adamw_picks_by_device():
    p = [torch.nn.Parameter(torch.ones(3))]
    assert clip_folds_into_step(TritonAdamW(p), fsdp=False)
    assert not clip_folds_into_step(TritonAdamW(p), fsdp=True)
    cpu = torch.device("cpu")
    common = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    assert type(adamw(p, fused=None, device=cpu, **common)) is torch.optim.AdamW
    assert adamw(p, fused=True, device=cpu, **common).defaults["fused"]
    assert not adamw(p, fused=False, device=cpu, **common).defaults["fused"]


def test_adamw_update_rejects_mismatched_shapes_and_cpu_tensors():
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="differ"):
        triton_kernels.adamw_update(x, torch.zeros(5), x.clone(), x.clone(), lr=1e-3, beta1=0.9, beta2=0.99,
                                    eps=1e-8, weight_decay=0.0, step=1)
    with pytest.raises(ValueError, match="CUDA fp32"):
        triton_kernels.adamw_update(x, x.clone(), x.clone(), x.clone(), lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8,
                                    weight_decay=0.0, step=1)


@pytest.mark.skipif(not CUDA, reason="the Triton AdamW kernel runs on CUDA")
@pytest.mark.parametrize("maximize", [False, True])
def test_triton_kernel_matches_torch_fused_adamw_and_leaves_gradients_unscaled(maximize):
    ps, opt, seen, grads = run_steps(TritonAdamW, "cuda", maximize=maximize)
    want, _, want_seen, _ = run_steps(torch.optim.AdamW, "cuda", fused=True, maximize=maximize)
    assert all(triton_kernels.adamw_usable([p, p.grad]) for p in ps)  # the kernel, not the fallback, stepped
    for p, q in zip(ps, want):
        torch.testing.assert_close(p, q, rtol=2e-6, atol=1e-7)
    # the kernel reads the gradient divided by the clip factor and does not write it back
    for got, given in zip(seen[1], grads[1]):
        torch.testing.assert_close(got, given.cuda(), rtol=0, atol=0)
    # torch's fused AdamW writes the divided gradient back (the traffic the kernel saves)
    torch.testing.assert_close(want_seen[1][0], grads[1][0].cuda() / 3.0)


@pytest.mark.skipif(not CUDA, reason="the Triton AdamW kernel runs on CUDA")
def test_tensor_subclasses_go_to_torchs_step():
    """A DTensor (FSDP) or any other subclass is not handed to the kernel: its pointer is not its data."""
    class Wrapped(torch.Tensor):
        pass

    plain = torch.zeros(4, device="cuda")
    assert triton_kernels.adamw_usable([plain, torch.nn.Parameter(plain.clone())])
    assert not triton_kernels.adamw_usable([plain.as_subclass(Wrapped)])


@pytest.mark.skipif(not CUDA, reason="the Triton AdamW kernel runs on CUDA")
def test_triton_adamw_through_clip_gradients_matches_clip_then_torch_adamw():
    """train/distributed.clip_gradients + optimizer_step with the Triton AdamW = torch's clip, then a plain step."""
    ps, grads = params_and_grads("cuda", seed=4)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt = TritonAdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    ref = torch.optim.AdamW(twin, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    for step_grads in grads:
        for p, q, gr in zip(ps, twin, step_grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        norm = clip_gradients(None, opt, ps, 0.5, fsdp=False)
        assert hasattr(opt, "grad_scale")
        optimizer_step(opt)
        torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(twin, 0.5))
        ref.step()
    for p, q in zip(ps, twin):
        torch.testing.assert_close(p, q, rtol=2e-6, atol=1e-7)
