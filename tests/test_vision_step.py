"""k25-mini's joint vision step without per-step overhead (data/mini_world/vision_step.py) trains exactly as the
plain loop did: the same batches, losses and weights, bit for bit, as `wrapper(**collate(batch))` + the text
blocks' loss; and the deterministic block keeps torch's NaN fill of new tensors."""
import copy

import pytest
import torch

from data.mini_world import vision as eyes
from data.mini_world.lm import BatchSampler
from data.mini_world.vision_step import JointStep, PoolTensors
from tests.fixtures.images import media_tokenizer, vision_config  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def seeing_setup(media_tokenizer):
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    from data.mini_world import checkpoints as ck

    tok = AutoTokenizer.from_pretrained(str(media_tokenizer))
    cfg = ck.deepseek_v3_config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                                pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    wrapper = ck.build_kimi_k25(DeepseekV3ForCausalLM(cfg), vision_config(), seed=1,
                                image_token_id=eyes.media_pad_id(tok))
    eyes.calm_position_table(wrapper)
    pool = eyes.example_pool(tok, 12, seed=4, size=56, max_turns=2)
    blocks = torch.randint(0, 500, (6, 32), generator=torch.Generator().manual_seed(2))
    return tok, wrapper, pool, blocks


def _train(wrapper, tok, pool, blocks, fast: bool, steps: int = 3):
    """`steps` AdamW steps of 4 images + 2 text blocks; the image losses, the joint losses, the weights."""
    model = copy.deepcopy(wrapper).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    images, texts = BatchSampler(len(pool), 4, 7), BatchSampler(len(blocks), 2, 8)
    step = JointStep(model, pool, blocks, tok.pad_token_id, images, texts, torch.device("cpu")) if fast else None
    image_losses, losses = [], []
    for i in range(steps):
        if fast:
            loss = step(i)
        else:
            batch = eyes.collate([pool[j] for j in images.next().tolist()], tok.pad_token_id)
            loss = model(**batch).loss
            image_losses.append(loss.item())
            b = blocks[texts.next()]
            loss = loss + model(input_ids=b, labels=b).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if fast:
        image_losses = step.image_losses()
    return image_losses, losses, {k: v.clone() for k, v in model.state_dict().items()}


def test_joint_step_trains_bit_identically_to_the_wrappers_own_forward(seeing_setup):
    tok, wrapper, pool, blocks = seeing_setup
    plain = _train(wrapper, tok, pool, blocks, fast=False)
    fast = _train(wrapper, tok, pool, blocks, fast=True)
    assert plain[0] == fast[0] and plain[1] == fast[1]  # every loss, exactly
    assert plain[1][0] != plain[1][-1]  # it trained
    changed = [k for k in plain[2] if not torch.equal(plain[2][k], wrapper.state_dict()[k])]
    assert any(".vision_tower." in k for k in changed) and any("language_model" in k for k in changed)
    assert all(torch.equal(plain[2][k], fast[2][k]) for k in plain[2])  # every weight, bit for bit


def test_text_loss_weight_scales_only_the_text_part(seeing_setup):
    """text_weight w: the joint loss is image + w * text on the same batches (the image part unchanged)."""
    tok, wrapper, pool, blocks = seeing_setup
    model = copy.deepcopy(wrapper).eval()

    def first_step(weight):
        images, texts = BatchSampler(len(pool), 4, 7), BatchSampler(len(blocks), 2, 8)
        step = JointStep(model, pool, blocks, tok.pad_token_id, images, texts, torch.device("cpu"), text_weight=weight)
        with torch.no_grad():
            return step(0).item(), step.image_losses()[0]

    (full, image1), (quarter, image2) = first_step(1.0), first_step(0.25)
    assert image1 == image2 and full - image1 > 0.1
    assert quarter - image2 == pytest.approx(0.25 * (full - image1), rel=1e-4)


def test_pool_batch_is_collate(seeing_setup):
    tok, wrapper, pool, _ = seeing_setup
    pt = PoolTensors(pool, tok.pad_token_id, eyes.media_pad_id(tok), lambda g: 4, torch.device("cpu"))
    idx = torch.tensor([5, 0, 11, 3])
    want, got = eyes.collate([pool[i] for i in idx.tolist()], tok.pad_token_id), pt.batch(idx)
    assert sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want)


def test_pool_refuses_a_wrong_placeholder_count_and_mixed_sizes(seeing_setup):
    tok, _, pool, _ = seeing_setup
    pad = eyes.media_pad_id(tok)
    with pytest.raises(ValueError, match=r"pool example 0: 4 <\|media_pad\|> ids for an image of 16 rows"):
        PoolTensors(pool, tok.pad_token_id, pad, lambda g: 16, torch.device("cpu"))
    odd = copy.copy(pool[1])
    odd.pixels = odd.pixels[:4]
    with pytest.raises(ValueError, match="differ in patch count"):
        PoolTensors([pool[0], odd], tok.pad_token_id, pad, lambda g: 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="empty"):
        PoolTensors([], tok.pad_token_id, pad, lambda g: 4, torch.device("cpu"))


def test_deterministic_block_keeps_the_nan_fill_of_new_tensors():
    """A read of memory nobody wrote must fail a build (NaN), not change its bits from run to run."""
    from eagle3.world import deterministic_algorithms

    with deterministic_algorithms([]):
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.utils.deterministic.fill_uninitialized_memory
        assert torch.isnan(torch.empty(8)).all()


def test_a_non_finite_loss_fails_the_run_naming_its_step():
    from data.mini_world.lm import optimise
    from eagle3.config.schema.mini_world import MiniTrainConf

    model = torch.nn.Linear(2, 1)
    cfg = MiniTrainConf(steps=6, lr=1e-3, warmup_steps=1)
    loss_at = lambda step: model(torch.ones(1, 2)).sum() * (float("nan") if step == 2 else 1.0)  # noqa: E731
    with pytest.raises(FloatingPointError, match=r"loss became nan at step 2 \(found at step 3\)"):
        optimise(model, cfg, loss_at, desc="t", check_every=4)
    stats = optimise(torch.nn.Linear(2, 1), cfg, lambda step: torch.tensor(float(step), requires_grad=True),
                     desc="t", check_every=4)
    assert stats["first_loss"] == 0.0 and stats["final_loss"] == 5.0


def test_tower_lr_scale_zero_keeps_the_tower_as_drawn_and_trains_the_rest(seeing_setup):
    """vision.tower_lr_scale through the world's own train_seeing: 0 leaves every tower weight as drawn while the
    projector and the LM train; the default (1) trains the tower too. The per-parameter rates: tower
    vision x tower scale, projector vision scale, LM 1."""
    from dataclasses import replace

    from eagle3.config.schema.mini_world import MiniVisionConf

    tok, wrapper, pool, blocks = seeing_setup
    base = MiniVisionConf()
    conf = replace(base, train=replace(base.train, steps=3, batch_size=4, warmup_steps=1), text_batch_size=2,
                   vision_lr_scale=2.0)

    start = copy.deepcopy(wrapper)
    eyes.calm_position_table(start)  # what train_seeing starts from (it calms the tower first)
    before = start.state_dict()

    def trained(tower_scale):
        model = copy.deepcopy(wrapper)
        eyes.train_seeing(model, tok, pool, blocks, replace(conf, tower_lr_scale=tower_scale), seed=3,
                          device=torch.device("cpu"))
        tower = list(model.model.vision_tower.parameters())
        assert all(p.requires_grad for p in tower)  # the flags are put back after training
        if tower_scale == 0:
            assert all(p.grad is None for p in tower)  # left out of the step: no gradient was computed
        return {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}

    frozen, moving = trained(0.0), trained(1.0)
    assert not any(".vision_tower." in k for k in frozen)
    assert any(".mm_projector." in k for k in frozen) and any("language_model" in k for k in frozen)
    assert any(".vision_tower." in k for k in moving)
    c = replace(conf, tower_lr_scale=0.25)
    assert eyes.vision_lr_scale("model.vision_tower.encoder.blocks.0.wqkv.weight", c) == 0.5
    assert eyes.vision_lr_scale("model.mm_projector.out_proj.weight", c) == 2.0
    assert eyes.vision_lr_scale("model.language_model.layers.0.mlp.gate_proj.weight", c) == 1.0


def test_the_cpu_default_is_the_frozen_recipe_and_leaves_the_tower_as_drawn(seeing_setup, tmp_path):
    """conf/mini_world.yaml's eyes (issue 44): the tower frozen over 2000 joint steps; the gpu and ci presets pin
    their own trained-tower recipes. The default's own vision settings, through train_seeing (2 of its steps),
    leave every tower weight as drawn."""
    from dataclasses import replace

    from eagle3.config.conf import compose, to_schema
    from eagle3.config.schema.demo import DemoConfig
    from eagle3.config.schema.mini_world import MiniWorldConfig

    def world(*o):
        return to_schema(compose("mini_world", [f"paths.root={tmp_path}", *o]), MiniWorldConfig).vision

    default = world()
    assert default.tower_lr_scale == 0 and default.train.steps == 2000
    for size, steps in (("gpu", 500), ("ci", 10)):
        preset = to_schema(compose("demo", [f"paths.root={tmp_path}", f"demo_size={size}"]), DemoConfig)
        pinned = world(*preset.overrides.mini_world)
        assert pinned.tower_lr_scale == 1.0 and pinned.train.steps == steps

    tok, wrapper, pool, blocks = seeing_setup
    start = copy.deepcopy(wrapper)
    eyes.calm_position_table(start)  # train_seeing calms the tower's position table first
    before = {k: v.clone() for k, v in start.model.vision_tower.state_dict().items()}
    model = copy.deepcopy(wrapper)
    conf = replace(default, train=replace(default.train, steps=2, batch_size=4, warmup_steps=1))
    eyes.train_seeing(model, tok, pool, blocks, conf, seed=3, device=torch.device("cpu"))
    after = model.model.vision_tower.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert not torch.equal(model.model.mm_projector.state_dict()[next(iter(model.model.mm_projector.state_dict()))],
                           start.model.mm_projector.state_dict()[next(iter(start.model.mm_projector.state_dict()))])
