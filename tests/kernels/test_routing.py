"""Router replay on a tiny transformers Qwen3-MoE.

    .venv/bin/python -m pytest tests/kernels/test_routing.py -q
"""

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from kernels.routing import capture_routing, gate_weights, moe_routers, replay_routing


def tiny_moe(norm_topk_prob: bool = True, seed: int = 0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob, max_position_embeddings=64, tie_word_embeddings=False,
    )
    model = Qwen3MoeForCausalLM(cfg)
    for router in moe_routers(model):  # the default init is near zero; make routing decisive
        torch.nn.init.normal_(router.weight, std=1.0)
    return model


class ExpertInputs:
    """What the experts actually received: ids and weights, per layer, per forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.ids: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []
        blocks = [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate")]
        self.handles = [b.experts.register_forward_pre_hook(self.hook, with_kwargs=True) for b in blocks]

    def hook(self, module, args, kwargs):
        values = list(args) + list(kwargs.values())
        self.ids.append(values[1].detach().clone())
        self.weights.append(values[2].detach().clone())

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def perturb_routers(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for router in moe_routers(model):
            router.weight.add_(torch.randn_like(router.weight) * 2.0)


def test_it_captures_top_k_ids_per_layer_per_token():
    model = tiny_moe()
    ids = torch.randint(0, 32, (3, 7))
    with capture_routing(model) as cap:
        model(input_ids=ids)
    routing = cap.routing()
    assert routing.shape == (2, 21, 2) and routing.dtype == torch.int64
    assert int(routing.min()) >= 0 and int(routing.max()) < 8


def test_replaying_the_models_own_routing_changes_nothing():
    model = tiny_moe()
    ids = torch.randint(0, 32, (2, 9))
    with capture_routing(model) as cap:
        plain = model(input_ids=ids).logits
    with replay_routing(model, cap.routing()) as stats:
        replayed = model(input_ids=ids).logits
    assert torch.equal(plain, replayed)
    assert stats.replayed == 18 * 2 and stats.differed == 0


def test_with_replay_the_trainer_uses_the_recorded_experts_for_every_token():
    model = tiny_moe()
    ids = torch.randint(0, 32, (4, 12))
    with capture_routing(model) as cap:
        model(input_ids=ids)
    recorded = cap.routing()  # (L, N, k) "from inference"
    perturb_routers(model)  # the trainer's weights moved on since sampling

    seen = ExpertInputs(model)
    model(input_ids=ids)
    own = torch.stack(seen.ids)  # (L, N, k) what the trainer picks by itself
    differ = (own.sort(-1).values != recorded.sort(-1).values).any(-1).float().mean().item()
    assert differ > 0.2  # the crafted batch shows the mismatch without replay

    seen.ids.clear()
    with replay_routing(model, recorded) as stats:
        model(input_ids=ids)
    seen.close()
    assert torch.equal(torch.stack(seen.ids), recorded)  # 100% of tokens, every layer
    # Later layers see replayed inputs, so only the first layer's count must match exactly.
    first_layer = (own[0].sort(-1).values != recorded[0].sort(-1).values).any(-1).sum().item()
    assert stats.differed >= first_layer > 0 and stats.mismatch_fraction > 0.2


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_gate_weights_are_recomputed_from_the_current_router_logits(norm_topk_prob):
    model = tiny_moe(norm_topk_prob=norm_topk_prob)
    ids = torch.randint(0, 32, (2, 6))
    with capture_routing(model) as cap:
        model(input_ids=ids)
    recorded = cap.routing()
    perturb_routers(model)
    logits_seen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, a, out: logits_seen.append(out[0].detach())) for r in moe_routers(model)]
    seen = ExpertInputs(model)
    with replay_routing(model, recorded):
        model(input_ids=ids)
    seen.close()
    for h in hooks:
        h.remove()
    for layer in range(2):
        probs = torch.softmax(logits_seen[layer].float(), -1).gather(1, recorded[layer])  # (N, k)
        expected = probs / probs.sum(-1, keepdim=True) if norm_topk_prob else probs
        assert torch.allclose(seen.weights[layer], expected, atol=1e-6)
        assert torch.allclose(gate_weights(logits_seen[layer], recorded[layer], norm_topk_prob), expected)
        if norm_topk_prob:
            assert torch.allclose(seen.weights[layer].sum(-1), torch.ones(12))


def test_the_router_still_gets_a_gradient_under_replay():
    model = tiny_moe()
    ids = torch.randint(0, 32, (2, 6))
    with capture_routing(model) as cap:
        model(input_ids=ids)
    with replay_routing(model, cap.routing()):
        model(input_ids=ids).logits.sum().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in moe_routers(model))


def test_unrecorded_tokens_keep_the_routers_own_choice_and_bad_shapes_are_refused():
    model = tiny_moe()
    ids = torch.randint(0, 32, (1, 5))
    with capture_routing(model) as cap:
        model(input_ids=ids)
    own = cap.routing()
    forced = torch.full_like(own, -1)
    with replay_routing(model, forced) as stats, capture_routing(model) as again:
        model(input_ids=ids)
    assert torch.equal(again.routing(), own) and stats.replayed == 0
    with pytest.raises(ValueError, match="tokens"), replay_routing(model, own[:, :3]):
        model(input_ids=ids)
    with pytest.raises(ValueError, match="routing must be"), replay_routing(model, own[0]):
        pass


def test_successive_forward_calls_consume_successive_tokens():
    model = tiny_moe()
    ids = torch.randint(0, 32, (1, 8))
    with capture_routing(model) as cap:
        model(input_ids=ids)
    perturb_routers(model)
    with replay_routing(model, cap.routing()), capture_routing(model) as again:
        model(input_ids=ids[:, :5])
        model(input_ids=ids[:, :3])  # a second call reads tokens 5..7 of the recording
    assert torch.equal(again.routing(), cap.routing())
