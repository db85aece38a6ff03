"""The MTP head (ninfer.models.mtp) on the paged KV matches a plain reference of the MTP step.

transformers ignores `mtp.*` on load, so the oracle here is written from qwen35-architecture.md
section 4 directly: one token at a time, keys and values in a plain per-position list, dense
causal attention, every norm spelled out. Covered, dense and MoE, in float32: a ragged two-sequence
prefill (pages shuffled, crossing page boundaries) then k=3 chained drafts; a second round that
rewrites the head's KV at the accepted positions (where the first chain wrote its own) and drafts
again; the head's KV in a cache of its own or as one more layer of the trunk's.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ninfer.forward import ForwardBatch, ModelCache
from ninfer.models import prepare_for_inference_
from ninfer.models.mtp import MTPHead, chain_batch, mtp_config_from_text
from ninfer.models.qwen3_5 import QWEN3_6_SHAPES, Qwen3_5ForCausalLM

VOCAB = 256
PAGE_SIZE = 4  # small pages: every sequence crosses several
NUM_PAGES = 16
HIDDEN_ATOL = 1e-4  # float32 hidden states of O(1) (max abs diff); only summation order differs
K = 3


def small_config(kind: str) -> dict:
    cfg = copy.deepcopy(QWEN3_6_SHAPES["tiny-qwen3.6-moe" if kind == "moe" else "tiny-qwen3.6"])
    cfg["vocab_size"] = VOCAB
    cfg["num_hidden_layers"] = 4
    cfg["layer_types"] = cfg["layer_types"][:4]
    return cfg


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int) -> None:
    """O(1) activations with every path mattering: norms off their centre, unit-gain linears."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("linear_attn.norm.weight"):
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
        elif name.endswith("norm.weight"):
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        elif leaf == "A_log":
            p.copy_(torch.empty(p.shape).uniform_(0.01, 0.5, generator=gen).log())
        elif leaf == "dt_bias" or "conv1d" in name:
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


# ---------------------------------------------------------------------------------------------
# The reference: one MTP step for one token, written from the architecture description.


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm (every MTP norm): x / rms(x) * (1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


class ReferenceMTP:
    def __init__(self, head: MTPHead, trunk: Qwen3_5ForCausalLM):
        self.w = {k: v.detach().clone() for k, v in head.state_dict().items()}
        cfg = head.config
        self.eps = cfg["rms_norm_eps"]
        self.hq, self.hkv, self.d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.moe = bool(cfg.get("num_experts"))
        self.top_k = cfg.get("num_experts_per_tok")
        self.embed = trunk.embed_tokens.weight.detach().clone()
        self.lm_head = trunk.lm_head.weight.detach().clone()
        rope = trunk.config["rope_parameters"]
        self.rotary_dim = int(self.d * rope["partial_rotary_factor"])
        # text positions: all mRoPE axes agree, so this is plain RoPE on the first rotary_dim channels
        self.inv_freq = 1.0 / rope["rope_theta"] ** (torch.arange(0, self.rotary_dim, 2).float() / self.rotary_dim)

    def rope(self, x: torch.Tensor, pos: int) -> torch.Tensor:  # x [heads, D]
        r = self.rotary_dim
        ang = pos * self.inv_freq
        cos, sin = torch.cat([ang, ang]).cos(), torch.cat([ang, ang]).sin()
        x1, x2 = x[:, : r // 2], x[:, r // 2 : r]
        rotated = torch.cat([-x2, x1], dim=-1)
        return torch.cat([x[:, :r] * cos + rotated * sin, x[:, r:]], dim=-1)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        w, p = self.w, "layers.0.mlp."

        def swiglu(prefix):
            return w[prefix + "down_proj.weight"] @ (
                torch.nn.functional.silu(w[prefix + "gate_proj.weight"] @ x) * (w[prefix + "up_proj.weight"] @ x))

        if not self.moe:
            return swiglu(p)
        probs = torch.softmax(w[p + "gate.weight"] @ x, dim=-1)
        top_w, top_i = probs.topk(self.top_k)
        top_w = top_w / top_w.sum()
        gate_up, down = w[p + "experts.gate_up_proj"], w[p + "experts.down_proj"]
        inter = down.shape[-1]
        routed = torch.zeros_like(x)
        for weight, e in zip(top_w, top_i.tolist()):
            g, u = gate_up[e, :inter] @ x, gate_up[e, inter:] @ x
            routed += weight * (down[e] @ (torch.nn.functional.silu(g) * u))
        shared_gate = torch.sigmoid(w[p + "shared_expert_gate.weight"] @ x)
        return routed + shared_gate * swiglu(p + "shared_expert.")

    def step(self, kv: dict[int, tuple], pos: int, token: int, h: torch.Tensor) -> torch.Tensor:
        """The head's output (post `norm`) at position pos for (token after pos, hidden at pos); kv holds
        this sequence's keys/values by position, written (or overwritten) here."""
        w, eps, p = self.w, self.eps, "layers.0.self_attn."
        x = w["fc.weight"] @ torch.cat([rms(self.embed[token], w["pre_fc_norm_embedding.weight"], eps),
                                        rms(h, w["pre_fc_norm_hidden.weight"], eps)])  # embedding first
        a = rms(x, w["layers.0.input_layernorm.weight"], eps)
        qg = (w[p + "q_proj.weight"] @ a).view(self.hq, 2 * self.d)  # per head: [query | gate]
        q, gate = qg[:, : self.d], qg[:, self.d :]
        k = (w[p + "k_proj.weight"] @ a).view(self.hkv, self.d)
        v = (w[p + "v_proj.weight"] @ a).view(self.hkv, self.d)
        q = self.rope(rms(q, w[p + "q_norm.weight"], eps), pos)
        k = self.rope(rms(k, w[p + "k_norm.weight"], eps), pos)
        kv[pos] = (k, v)
        keys = torch.stack([kv[i][0] for i in range(pos + 1)])  # [n, Hkv, D]: causal, positions 0..pos
        values = torch.stack([kv[i][1] for i in range(pos + 1)])
        group = self.hq // self.hkv
        heads = []
        for head in range(self.hq):
            scores = keys[:, head // group] @ q[head] * self.d**-0.5
            heads.append(torch.softmax(scores, dim=0) @ values[:, head // group])
        attn = torch.cat(heads) * torch.sigmoid(gate.reshape(-1))
        x = x + w[p + "o_proj.weight"] @ attn
        x = x + self.mlp(rms(x, w["layers.0.post_attention_layernorm.weight"], eps))
        return rms(x, w["norm.weight"], eps)

    def draft(self, h: torch.Tensor) -> int:
        return int((self.lm_head @ h).argmax())

    def propose(self, kv, start: int, tokens: list[int], hidden: torch.Tensor, k: int):
        """Rows at positions start.. then k-1 chained steps -> (drafts, chain outputs)."""
        out = None
        for i, (tok, h) in enumerate(zip(tokens, hidden)):
            out = self.step(kv, start + i, tok, h)
        outs, drafts = [out], [self.draft(out)]
        pos = start + len(tokens) - 1
        for _ in range(k - 1):
            pos += 1
            out = self.step(kv, pos, drafts[-1], out)
            outs.append(out)
            drafts.append(self.draft(out))
        return drafts, torch.stack(outs)


# ---------------------------------------------------------------------------------------------


def build(kind: str, shared_cache: bool):
    cfg = small_config(kind)
    torch.manual_seed(0)
    trunk = Qwen3_5ForCausalLM(cfg).eval()
    randomize(trunk, seed=1)
    head = MTPHead(mtp_config_from_text(cfg), kv_layer=trunk.num_attn_layers if shared_cache else 0).eval()
    randomize(head, seed=2)
    ref = ReferenceMTP(head, trunk)  # from the checkpoint-named weights, before fusion
    prepare_for_inference_(trunk)
    prepare_for_inference_(head.attach_(trunk))  # the run-time form: merged projections
    if shared_cache:
        cache = ModelCache(head.cache_spec(trunk.cache_spec()), NUM_PAGES, PAGE_SIZE, 2, torch.float32)
        trunk_cache = cache
    else:
        cache = ModelCache(head.cache_spec(), NUM_PAGES, PAGE_SIZE, 1, torch.float32)
        trunk_cache = ModelCache(trunk.cache_spec(), NUM_PAGES, PAGE_SIZE, 2, torch.float32)
    return trunk, head, ref, cache, trunk_cache


def batch_of(tokens, cached, pages):
    return ForwardBatch.build(tokens, cached, pages, PAGE_SIZE, state_slots=list(range(len(tokens))))


@pytest.mark.parametrize("shared_cache", [False, True], ids=["own-cache", "trunk-cache"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
@torch.no_grad()
def test_prefill_then_chained_drafts_match_the_reference_over_two_rounds(kind, shared_cache):
    trunk, head, ref, cache, trunk_cache = build(kind, shared_cache)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (7, 5)]
    pages = [[9, 2, 14, 5], [11, 0, 7, 3]]  # shuffled, 16 positions each
    kvs = [{}, {}]

    # round 1: trunk prefill -> next token t_n; MTP rows 0..n-1 read (t_{i+1}, h_i), then K-1 chained
    pre = batch_of(prompts, [0, 0], pages)
    hidden = trunk(pre, trunk_cache)
    firsts = trunk.compute_logits(hidden[pre.last_token_indices()]).argmax(-1).tolist()
    mtp_ids = [p[1:] + [t] for p, t in zip(prompts, firsts)]
    step0 = batch_of(mtp_ids, [0, 0], pages)
    drafts = head.propose(step0, cache, step0.input_ids, hidden, K)
    assert drafts.shape == (2, K) and drafts.dtype == torch.long
    for i, hs in enumerate(hidden.split(pre.query_lens_cpu)):
        want, _ = ref.propose(kvs[i], 0, mtp_ids[i], hs, K)
        assert drafts[i].tolist() == want

    # round 2: the trunk verifies [t_n, d_1..d_K]; sequence 0 accepts 2 drafts, sequence 1 none. The head
    # then rereads the accepted positions from the trunk (overwriting what its chain wrote there)
    verify = batch_of([[t, *d] for t, d in zip(firsts, drafts.tolist())], [len(p) for p in prompts], pages)
    verify.logits_indices = torch.arange(len(verify.input_ids))
    vh = trunk(verify, trunk_cache).split(verify.query_lens_cpu)
    accepted = [2, 0]
    bonus = [int(trunk.compute_logits(h[a : a + 1]).argmax()) for h, a in zip(vh, accepted)]
    ids2 = [d[:a] + [b] for d, a, b in zip(drafts.tolist(), accepted, bonus)]
    hid2 = [h[: a + 1] for h, a in zip(vh, accepted)]
    starts = [len(p) for p in prompts]
    step0 = batch_of(ids2, starts, pages)
    drafts2 = head.propose(step0, cache, step0.input_ids, torch.cat(hid2), K)
    for i in range(2):
        want, _ = ref.propose(kvs[i], starts[i], ids2[i], hid2[i], K)
        assert drafts2[i].tolist() == want


@pytest.mark.parametrize("kind", ["dense", "moe"])
@torch.no_grad()
def test_hidden_states_of_every_step_match_the_reference(kind):
    """The outputs themselves (not only their argmax), step by step through forward and chain_batch."""
    trunk, head, ref, cache, _ = build(kind, shared_cache=False)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (6,), generator=gen).tolist()
    hidden = torch.randn(6, trunk.config["hidden_size"], generator=gen)
    pages = [[13, 4, 8, 1]]
    _, want = ref.propose({}, 0, ids, hidden, K)
    batch = batch_of([ids], [0], pages)
    out = head(batch, cache, batch.input_ids, hidden)[-1:]
    got = [out]
    for _ in range(K - 1):
        batch = chain_batch(batch, PAGE_SIZE)
        out = head(batch, cache, head.compute_logits(out).argmax(-1), out)
        got.append(out)
    torch.testing.assert_close(torch.cat(got), want, atol=HIDDEN_ATOL, rtol=0)


def test_chain_batch_advances_positions_slots_and_lengths():
    pages = [[5, 2, 7], [1, 6, 3]]
    batch = ForwardBatch.build([[1, 2, 3, 4], [9]], [0, 6], pages, PAGE_SIZE,
                               positions=[None, [[6], [2], [3]]])  # sequence 1: mRoPE axes that differ
    step = chain_batch(batch, PAGE_SIZE)
    assert step.is_decode and step.seq_lens_cpu == [5, 8] and step.seq_lens.tolist() == [5, 8]
    assert step.positions.tolist() == [[4, 7], [4, 3], [4, 4]]  # each axis one on from the last token
    # KV index 4 of sequence 0 (page 2, offset 0); index 7 of sequence 1 (page 6, offset 3)
    assert step.slot_mapping.tolist() == [2 * PAGE_SIZE + 0, 6 * PAGE_SIZE + 3]
    assert step.query_start_loc.tolist() == [0, 1, 2]
    from ninfer.forward import DeviceOnlyLengths

    batch.seq_lens_cpu = DeviceOnlyLengths([0, 0])  # a CUDA graph's batch: the chain stays device-only
    step = chain_batch(batch, PAGE_SIZE)
    assert isinstance(step.seq_lens_cpu, DeviceOnlyLengths) and step.seq_lens.tolist() == [5, 8]


def test_head_state_dict_is_the_checkpoints_mtp_names():
    for kind in ("dense", "moe"):
        cfg = small_config(kind)
        head = MTPHead(mtp_config_from_text(cfg)).attach_(Qwen3_5ForCausalLM(cfg))
        names = set(head.state_dict())
        assert {"fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight",
                "layers.0.self_attn.q_proj.weight", "layers.0.input_layernorm.weight"} <= names
        assert not any(n.startswith(("embed_tokens", "lm_head", "_trunk", "rotary")) for n in names)  # shared
        assert ("layers.0.mlp.experts.gate_up_proj" in names) == (kind == "moe")
        assert head.fc.weight.shape == (cfg["hidden_size"], 2 * cfg["hidden_size"])
        prepare_for_inference_(head)
        assert set(head.state_dict()) == names  # fusion keeps the checkpoint's names


def test_unsupported_heads_fail_clearly():
    cfg = mtp_config_from_text(small_config("dense"))
    with pytest.raises(ValueError, match="2 layers"):
        MTPHead({**cfg, "num_hidden_layers": 2})
    with pytest.raises(RuntimeError, match="no trunk"):
        MTPHead(cfg).compute_logits(torch.zeros(1, cfg["hidden_size"]))


# ---------------------------------------------------------------------------------------------
# CUDA: the Triton kernels (paged attention, fused rope + KV write, GEMVs, MoE) and graph capture


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _to_cuda_bf16(trunk, head):
    trunk.to("cuda", torch.bfloat16)  # in place: the head keeps pointing at the same trunk
    head.to("cuda", torch.bfloat16)
    return ModelCache(head.cache_spec(), NUM_PAGES, PAGE_SIZE, 1, torch.bfloat16, "cuda")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("kind", ["dense", "moe"])
@torch.no_grad()
def test_cuda_bf16_steps_match_the_reference(kind):
    """The same steps as test_hidden_states_of_every_step_match_the_reference, teacher-forced with the
    reference's drafts, in bf16 through the CUDA kernels: within bf16 rounding of the fp32 oracle."""
    trunk, head, ref, _, _ = build(kind, shared_cache=False)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (6,), generator=gen).tolist()
    hidden = torch.randn(6, trunk.config["hidden_size"], generator=gen)
    drafts, want = ref.propose({}, 0, ids, hidden, K)
    cache = _to_cuda_bf16(trunk, head)
    batch = ForwardBatch.build([ids], [0], [[13, 4, 8, 1]], PAGE_SIZE, device="cuda")
    out = head(batch, cache, batch.input_ids, hidden.to("cuda", torch.bfloat16))[-1:]
    got = [out]
    for d in drafts[:-1]:
        batch = chain_batch(batch, PAGE_SIZE)
        out = head(batch, cache, torch.tensor([d], device="cuda"), out)
        got.append(out)
    err = (torch.cat(got).float().cpu() - want).abs().max() / want.abs().max()
    assert err < 0.03, err


@pytest.mark.cuda
@needs_cuda
@torch.no_grad()
def test_chained_draft_steps_capture_as_one_cuda_graph():
    """Steps 1..K-1 of propose (chain_batch, the head, logits, argmax) need no host sync: captured once,
    a replay equals the eager run, and new inputs copied into the static buffers are picked up."""
    from ninfer.engine.graphs import capture

    trunk, head, _, _, _ = build("moe", shared_cache=False)
    cache = _to_cuda_bf16(trunk, head)
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 3)]
    pages = [[9, 2, 14, 5], [11, 0, 7, 3]]
    step0 = ForwardBatch.build(ids, [0, 0], pages, PAGE_SIZE, device="cuda")
    hidden = torch.randn(8, trunk.config["hidden_size"], generator=gen).to("cuda", torch.bfloat16)
    head(step0, cache, step0.input_ids, hidden)  # the step-0 KV the chain attends to
    d0 = torch.tensor([3, 4], device="cuda")
    h0 = torch.randn(2, trunk.config["hidden_size"], generator=gen).to("cuda", torch.bfloat16)

    def chain():
        step, d, h, drafts = step0, d0, h0, []
        for _ in range(K - 1):
            step = chain_batch(step, PAGE_SIZE)
            h = head(step, cache, d, h)
            d = head.compute_logits(h).argmax(-1)
            drafts.append(d)
        return torch.stack(drafts, dim=1)

    eager = chain()
    graph, out = capture(chain, torch.device("cuda"), warmups=2)
    graph.replay()
    assert torch.equal(out, eager)
    d0.copy_(torch.tensor([7, 1]))
    h0.normal_()
    want = chain()
    graph.replay()
    assert torch.equal(out, want)
