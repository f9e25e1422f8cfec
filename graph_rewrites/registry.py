"""The rule registry: which fusions exist, in which order they run, and what each one did.

Rules run in stages (a later stage matches the ops an earlier one made). Every rule is an onnxscript
`RewriteRuleClassBase`, but for those no pattern states well (pack_projections: n siblings of one value;
qkv_rotary_cache: three roots), which are functions run at their stage that count for themselves. For the
pattern rules a tracer counts, per rule, the candidates whose structure matched (`tried`), those rewritten
(`matched`) and, for the refused ones, the node and the reason `check` gave. The best partial structural
match is kept too, for `--explain`.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter._basics import MatchStatus
from onnxscript.rewriter._rewrite_rule import RULE_NAME_TAG

from ort_triton.contract import DOMAIN

from . import attention as att
from . import causal_attention as causal
from . import embed_layer_norm as eln
from . import gelu, gemm
from . import layer_norm as ln
from . import linear as lin
from . import norm_linear as nl
from . import pack_qkv as pack
from . import padded_weight as pw
from . import rms_norm as rms
from . import rotary as rope
from . import swiglu as swi
from .common import NOT_A_CANDIDATE
from .pack_projections import pack_projections
from .qkv_rotary_cache import qkv_cache, qkv_norm_rotary_cache, qkv_rotary_cache


@dataclasses.dataclass(frozen=True)
class RuleInfo:
    name: str
    identity: str  # the one-line meaning, printed beside the counts
    stage: int
    make: Callable[[], list[pattern.RewriteRule]]
    commute: bool = False  # also try every operand order of commutative Add/Mul in the pattern
    emits: str | None = None  # a rule that makes a standard op, not ours: the op type its matches are counted by
    # a rewrite no pattern can state (make gives no rules): run(model) -> (tried, matched, [(node, reason)])
    run: Callable[[ir.Model], tuple[int, int, list[tuple[str, str]]]] | None = None
    # off unless asked for (`enable`, or named in `only`): a rule whose speed on the GPU is not measured yet
    default: bool = True


RULES: tuple[RuleInfo, ...] = (
    RuleInfo("layer_norm", "LayerNormalization(x, g, b) -> LayerNorm", 1,
             lambda: [ln.LayerNormalizationRule.rule("layer_norm")]),
    RuleInfo("layer_norm_decomposed", "(x - mean) / sqrt(var + eps) * g + b -> LayerNorm", 1,
             lambda: [ln.DecomposedLayerNormRule.rule("layer_norm_decomposed", axes_as_input=i, with_beta=True)
                      for i in (True, False)], commute=True),
    # After the form with a bias: at the scale Mul it would match first and leave the bias Add behind.
    RuleInfo("layer_norm_decomposed_no_beta", "(x - mean) / sqrt(var + eps) * g -> LayerNorm", 2,
             lambda: [ln.DecomposedLayerNormRule.rule("layer_norm_decomposed_no_beta", axes_as_input=i,
                                                      with_beta=False)
                      for i in (True, False)], commute=True),
    RuleInfo("gelu", "Gelu(s) (opset 20, erf or tanh) -> BiasGelu[Tanh](s, 0)", 1,
             lambda: [gelu.GeluOpRule.rule("gelu", tanh=t) for t in (False, True)]),
    RuleInfo("gelu_erf", "0.5 * s * (1 + erf(s / sqrt 2)) -> BiasGelu(s, 0)", 1,
             lambda: [gelu.GeluErfRule.rule("gelu_erf", form=f) for f in range(3)], commute=True),
    RuleInfo("gelu_tanh", "0.5 * s * (1 + tanh(sqrt(2/pi) (s + 0.044715 s^3))) -> BiasGeluTanh(s, 0)", 1,
             lambda: [gelu.GeluTanhRule.rule("gelu_tanh", form=f) for f in range(3)], commute=True),
    RuleInfo("bias_gelu", "BiasGelu[Tanh](x + b, 0) -> BiasGelu[Tanh](x, b)", 2,
             lambda: [gelu.FoldBiasRule.rule("bias_gelu", tanh=t) for t in (False, True)], commute=True),
    # Stage 3: after bias_gelu folded the gate's bias. One elementwise pass for two. On by default since its H100
    # run (session 28, bench/results/README.md): Gemma-2B prefill 1x512 1.037x, decode 1.016x (1x1024) and 1.003x
    # (16x1024), rounds 1.002-1.045.
    RuleInfo("gelu_mul", "Mul(BiasGelu[Tanh](x, b), u) -> BiasGelu[Tanh]Mul(x, b, u) (GeGLU: Gemma)", 3,
             lambda: [gelu.GeluMulRule.rule("gelu_mul", tanh=t) for t in (False, True)], commute=True),
    RuleInfo("embedding_shape", "Shape(Gather(table, ids)), the lookup summed -> Concat(Shape(ids), [H]) "
             "(DistilBERT's torchscript sequence length)", 1,
             lambda: [eln.EmbeddingShapeRule.rule("embedding_shape")], emits="Concat"),
    # Stage 3: the embeddings' norm is a LayerNorm by then (stages 1-2) and its Add not yet folded by
    # add_layer_norm (4). A stage of its own: the traced run (apply_rules) cannot see a rule try a node that
    # another rule of the same stage has just made, so the report would miss its refusals.
    RuleInfo("embed_layer_norm", "LayerNorm((word[ids] + type[tt]) + pos[pp]) (or word + pos) -> EmbedLayerNorm", 3,
             lambda: [eln.EmbedLayerNormRule.rule("embed_layer_norm", tables=n) for n in (3, 2)], commute=True),
    RuleInfo("add_layer_norm", "LayerNorm(a + b) -> AddLayerNorm(a, b)", 4,
             lambda: [ln.AddLayerNormRule.rule("add_layer_norm")]),
    RuleInfo("add_layer_norm_keep_sum", "LayerNorm(s = a + b), s used -> AddLayerNorm(a, b) -> (y, s)", 4,
             lambda: [ln.AddLayerNormKeepSumRule.rule("add_layer_norm_keep_sum")]),
    RuleInfo("bias_add_layer_norm", "AddLayerNorm(m + c, r) -> AddLayerNorm(m, r, bias=c)", 6,
             lambda: [ln.BiasAddLayerNormRule.rule("bias_add_layer_norm", biased_operand=o, keep_sum=k)
                      for o in (0, 1) for k in (False, True)], commute=True),
    RuleInfo("attention", "softmax(QK^T*s + mask)V, heads split/merged -> MultiHeadAttention", 5,
             lambda: [att.DecomposedAttentionRule.rule("attention")]),
    RuleInfo("attention_onnx", "ONNX Attention(Q, K, V, mask) on [B, N, S, D], heads split/merged -> "
             "MultiHeadAttention", 5, lambda: [att.OnnxAttentionRule.rule("attention_onnx")]),
    RuleInfo("attention_onnx_3d", "ONNX Attention(Q, K, V, mask; q_num_heads) on [B, S, hidden] -> "
             "MultiHeadAttention", 5, lambda: [att.OnnxAttention3dRule.rule("attention_onnx_3d")]),
    RuleInfo("attention_bias", "MultiHeadAttention(q, mk + ck, mv + cv) -> MultiHeadAttention(q, mk, mv, "
             "biases ck, cv)", 6, lambda: [att.AttentionBiasRule.rule("attention_bias")], commute=True),
    RuleInfo("attention_bias_one", "MultiHeadAttention(q, mk + ck, v) or (q, k, mv + cv), the other without a "
             "foldable bias -> that bias as an input", 7,
             lambda: [att.AttentionBiasRule.rule("attention_bias_one", fold=f) for f in ("k", "v")], commute=True),
    RuleInfo("pack_qkv", "MultiHeadAttention(x Wq + bq, x Wk, x Wv) -> PackedMultiHeadAttention(x [Wq|Wk|Wv], "
             "[bq|bk|bv])", 8, lambda: [pack.PackQkvRule.rule("pack_qkv", q_bias=b) for b in (True, False)],
             commute=True),
    # After pack_qkv: BERT's Q/K/V go into PackedMultiHeadAttention, this packs what is left (decoders)
    RuleInfo("pack_projections", "x @ W1 (+ b1), x @ W2 (+ b2), x @ W3 (+ b3), 3 or more -> "
             "Split(x @ (W1|W2|W3) (+ (b1|b2|b3)))", 9, lambda: [], run=pack_projections),
    RuleInfo("rms_norm", "RMSNormalization(x, g) (opset 23, last axis) -> RMSNorm", 1,
             lambda: [rms.RMSNormalizationRule.rule("rms_norm")]),
    RuleInfo("rms_norm_decomposed", "[Cast] x * 1/sqrt(mean(x^2) + eps) [Cast] * g -> RMSNorm", 1,
             lambda: [rms.DecomposedRMSNormRule.rule("rms_norm_decomposed", axes_as_input=i, cast_in=ci,
                                                     cast_out=co)
                      for ci in (True, False) for co in (True, False) for i in (True, False)], commute=True),
    RuleInfo("add_rms_norm", "RMSNorm(a + b) -> AddRMSNorm(a, b)", 4,
             lambda: [rms.AddRMSNormRule.rule("add_rms_norm", through_cast=c) for c in (False, True)]),
    RuleInfo("add_rms_norm_keep_sum", "RMSNorm(s = a + b), s used -> AddRMSNorm(a, b) -> (y, s)", 4,
             lambda: [rms.AddRMSNormKeepSumRule.rule("add_rms_norm_keep_sum", through_cast=c) for c in (False, True)]),
    RuleInfo("silu_mul", "Mul(g * Sigmoid(g), u) -> SiluMul(g, u) (SwiGLU)", 1,
             lambda: [swi.SiluMulRule.rule("silu_mul")], commute=True),
    RuleInfo("swish_mul", "Mul(Swish(g, alpha=1), u) (opset 24) -> SiluMul(g, u)", 1,
             lambda: [swi.SwishMulRule.rule("swish_mul")], commute=True),
    RuleInfo("rotary", "x * cos + cat(-x[..., D/2:], x[..., :D/2]) * sin -> Rotary", 1,
             lambda: [rope.RotaryRule.rule("rotary")], commute=True),
    RuleInfo("rotary_onnx", "RotaryEmbedding(x [B, N, S, D], cos, sin) (opset 23, no position_ids) -> Rotary", 1,
             lambda: [rope.OnnxRotaryRule.rule("rotary_onnx")]),
    RuleInfo("rotary_partial", "cat(Rotary(x[..., :R]), x[..., R:]) -> Rotary(x, rotary_dim=R)", 2,
             lambda: [rope.PartialRotaryRule.rule("rotary_partial")]),
    # Last: the other rules (causal_attention's Q and K) see the Rotary and Transpose as the exporter left them
    # On by default since its H200 run (session 14, bench/results/README.md): Llama-1B 1.018x geomean over prefill
    # and decode, 0.998x at prefill 8x512 (rounds 0.987-1.057), bit-identical logits.
    RuleInfo("transpose_rotary", "Rotary(Transpose(x [B, S, N, D], perm=[0, 2, 1, 3])) -> TransposeRotary(x)", 10,
             lambda: [rope.TransposeRotaryRule.rule("transpose_rotary")]),
    # After transpose_rotary (it reads its TransposeRotary nodes). On by default since its H200 run (session 14,
    # bench/results/README.md): Llama-1B decode 1.12x at 1x1024 and 16x1024, prefill 1.006-1.04x, same logits.
    # Qwen3's layers, q and k RMSNorm-ed per head before the rotaries: before qkv_rotary_cache, which refuses them.
    # On by default since its H100 run (session 27, bench/results/README.md): Qwen3-0.6B decode 1.233x at 1x1024,
    # prefill 1.095x at 1x512, bit-identical logits (eight launches of a decode step become one).
    RuleInfo("qkv_norm_rotary_cache", "Split(QKV) -> q, k, v heads; TransposeRotary(RMSNorm(q)), Concat(past_key, "
             "TransposeRotary(RMSNorm(k))), Concat(past_value, Transpose(v)) -> QKVNormRotaryCache", 11, lambda: [],
             run=qkv_norm_rotary_cache),
    RuleInfo("qkv_rotary_cache", "Split(QKV) -> q, k, v heads; TransposeRotary(q), Concat(past_key, "
             "TransposeRotary(k)), Concat(past_value, Transpose(v)) -> QKVRotaryCache", 11, lambda: [],
             run=qkv_rotary_cache),
    # The same walk for layers without rotary (GPT-2), the c_attn bias Add folded in. On by default since its H200
    # run (session 16, bench/results/README.md): GPT-2 small decode 1.16x at 1x1024, 1.18x at 16x1024, prefill 8x512
    # 1.08x, bit-identical logits.
    RuleInfo("qkv_cache", "Split(QKV + bias) -> q, k, v heads; Transpose(q), Concat(past_key, Transpose(k)), "
             "Concat(past_value, Transpose(v)) -> QKVCache", 11, lambda: [], run=qkv_cache),
    RuleInfo("causal_attention", "softmax(QK'^T*s + causal padding mask)V', GQA repeat_kv, heads merged -> "
             "CausalAttention", 5, lambda: [causal.CausalAttentionRule.rule("causal_attention")]),
    RuleInfo("causal_attention_onnx", "ONNX Attention(Q, K', V', causal padding mask) (opset 23), heads merged -> "
             "CausalAttention", 5, lambda: [causal.CausalOnnxAttentionRule.rule("causal_attention_onnx")]),
    RuleInfo("gemm_reshape", "Reshape(Gemm(Reshape(x, [-1, K]), W, b), [..., N]) -> MatMul(x, W) + b "
             "(GPT-2's Conv1D)", 1, lambda: [gemm.GemmReshapeRule.rule("gemm_reshape")], emits="MatMul"),
    # Last: every rule that reads a MatMul (bias folds, packing, attention) has run and sees the MatMul as
    # exported. Session 15's H200 profile found GPT-2 small's lm_head in cuBLAS's align1 GEMM (2.5 of 4.8 ms at
    # prefill 8x512). On by default since its H200 run (session 16, bench/results/README.md): GPT-2 small prefill
    # 1.25x at 1x512, 1.58x at 8x512, 1.42x at 1x2048, decode 1.00-1.04x; the Gemm on W^T tried first was slower
    # (0.87x at prefill).
    RuleInfo("padded_weight", "MatMul(x, W [K, N]), N * elem not 16-byte aligned -> Slice(MatMul(x, [W | 0] "
             "[K, N']), ends=[N]) (GPT-2's lm_head, vocab 50257)", 12,
             lambda: [pw.PaddedWeightOfTransposeRule.rule("padded_weight"),
                      pw.PaddedWeightRule.rule("padded_weight")], emits="Slice"),
    # After every rule that reads a MatMul (Q/K/V packed, padded weights padded), before linear, which would take
    # these MatMuls. Off until its A/B on the GPU.
    RuleInfo("add_rms_norm_linear", "MatMul(AddRMSNorm(x, skip, g), W) (or W = Transpose(C)) -> AddRMSNormLinear("
             "x, skip, g, W^T): the norm fused into the projection's GEMV", 13,
             lambda: [nl.AddRMSNormLinearRule.rule("add_rms_norm_linear", tied=t) for t in (True, False)],
             default=False),
    RuleInfo("add_rms_norm_swiglu", "SiluMul(AddRMSNorm(..) @ Wg, AddRMSNorm(..) @ Wu) -> AddRMSNormSwiGLU(x, skip, "
             "g, Wg^T, Wu^T): the norm and SwiGLU fused into the gate and up GEMVs", 13,
             lambda: [nl.AddRMSNormSwiGLURule.rule("add_rms_norm_swiglu")], default=False),
    # Last of all: every rule that reads a MatMul has run (padded_weight's padded weight is taken as padded).
    RuleInfo("linear", "MatMul(x, W [K, N]) or MatMul(x, Transpose(C [N, K])), W or C constant -> Linear(x, W^T "
             "or C): a GEMV or skinny tl.dot product of ours up to 16 rows, cuBLAS beyond", 14,
             lambda: [lin.LinearOfTransposeRule.rule("linear"), lin.LinearRule.rule("linear")], default=False),
)
BY_NAME = {r.name: r for r in RULES}


@dataclasses.dataclass
class Refusal:
    node: str
    reason: str


@dataclasses.dataclass
class RuleStats:
    name: str
    identity: str
    tried: int = 0  # candidates whose structure matched (traced run)
    matched: int = 0  # rewrites done (counted on the tagged replacement nodes)
    refused: list[Refusal] = dataclasses.field(default_factory=list)
    best_partial: Refusal | None = None  # for --explain: the largest structural match that failed

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _describe(node: ir.Node) -> str:
    return node.name or f"<{node.op_type} without a name>"


def _reason(match) -> str:
    reason = match.reason or "structure did not match"
    if _shared(match):
        reason = "an output of a matched node is also used outside the fused region"
    culprits = [f"{c.op_type} {_describe(c)}" if isinstance(c, ir.Node) else f"value {c.name}"
                for c in (match.failure_nodes_and_values or [])]
    return f"{reason} (at {', '.join(culprits)})" if culprits else reason


def _shared(match) -> bool:
    """The whole structure matched but an inner value is also used outside the match (onnxscript reports
    it as NO_MATCH with this reason): a refusal worth showing, not a partial match."""
    return match is not None and "other uses" in (match.reason or "")


class StatsTracer:
    """Implements the `log` hook of onnxscript's MatchingTracer; one RuleStats per RuleInfo."""

    def __init__(self, owners: dict[int, RuleInfo]):
        self.owners = owners
        self.stats = {info.name: RuleStats(info.name, info.identity) for info in owners.values()}
        self._seen: dict[str, dict[str, str]] = {name: {} for name in self.stats}
        self._partial_score: dict[str, int] = {}

    def log(self, rule, container, node, match_result, status) -> None:
        name = self.owners[id(rule)].name
        # unnamed nodes are told apart by identity (the traced run works on one copy throughout)
        seen, key = self._seen[name], node.name or f"{_describe(node)}#{id(node)}"
        if status == MatchStatus.SUCCESS:
            seen[key] = "matched"
        elif status == MatchStatus.CONDITION_FAILED and (match_result.reason or "").startswith(NOT_A_CANDIDATE):
            return  # not a candidate (common.NOT_A_CANDIDATE): neither tried nor refused
        elif status in (MatchStatus.CONDITION_FAILED, MatchStatus.REPLACEMENT_FAILED) or _shared(match_result):
            if seen.get(key) != "matched":  # a commuted variant may still match
                seen[key] = _describe(node) + "\0" + _reason(match_result)
        elif match_result is not None:
            score = len(match_result.nodes)
            if score > self._partial_score.get(name, 0):
                self._partial_score[name] = score
                self.stats[name].best_partial = Refusal(_describe(node), _reason(match_result) +
                                                        f"; {score} node(s) matched from {node.op_type}")

    def finish(self) -> dict[str, RuleStats]:
        for name, seen in self._seen.items():
            st = self.stats[name]
            st.tried = len(seen)
            st.refused = [Refusal(*v.split("\0", 1)) for v in seen.values() if v != "matched"]
        return self.stats


def select(only: list[str] | None = None, disable: list[str] | None = None,
           enable: list[str] | None = None) -> list[RuleInfo]:
    """The rules to run: `only` these (any, default or not), else the default ones and those of `enable`; less
    those of `disable`."""
    for n in (only or []) + (disable or []) + (enable or []):
        if n not in BY_NAME:
            raise ValueError(f"unknown rule {n!r}; rules: {', '.join(BY_NAME)}")
    wanted = (lambda r: r.name in only) if only else (lambda r: r.default or r.name in (enable or []))
    return [r for r in RULES if wanted(r) and r.name not in (disable or [])]


def _tagged(graph: ir.Graph) -> collections.Counter:
    """Nodes of our domain (or of the op type a rule `emits`) by the rule that made them. onnxscript tags
    each replacement node and merges the tags of the nodes it replaced behind it ("add_layer_norm,
    layer_norm"): the first is the maker."""
    counts = collections.Counter()
    for n in ir.traversal.RecursiveGraphIterator(graph):
        maker = n.metadata_props.get(RULE_NAME_TAG, "").split(",")[0].strip()
        info = BY_NAME.get(maker)
        if n.domain == DOMAIN or (info is not None and info.emits == n.op_type and n.domain in ("", "ai.onnx")):
            counts[maker] += 1
    return counts


def apply_rules(model: ir.Model, rules: list[RuleInfo], progress=None) -> dict[str, RuleStats]:
    """Apply `rules` stage by stage. onnxscript's tracer only observes (it disables rewriting), so each
    stage runs twice: traced on a clone (new nodes and values, the same tensors: no copy of the weights),
    for tried/refused/partial matches (the traced run still builds replacement nodes, which stay attached
    as users of the matched inputs), then for real."""
    owners: dict[int, RuleInfo] = {}
    staged: dict[int, list[pattern.RewriteRule]] = {}
    for info in rules:
        for rule in info.make():
            for variant in (rule.commute() if info.commute else [rule]):
                owners[id(variant)] = info
                staged.setdefault(info.stage, []).append(variant)
    passes = [info for info in rules if info.run is not None]
    for info in passes:
        staged.setdefault(info.stage, [])
    tracer = StatsTracer(owners)
    matched: collections.Counter = collections.Counter()
    ran: dict[str, RuleStats] = {}
    for i, stage in enumerate(sorted(staged)):
        if progress:
            progress(i, len(staged), ", ".join(sorted({owners[id(r)].name for r in staged[stage]} |
                                                      {p.name for p in passes if p.stage == stage})))
        for info in (p for p in passes if p.stage == stage):
            tried, n, refused = info.run(model)
            ran[info.name] = RuleStats(info.name, info.identity, tried, n, [Refusal(*r) for r in refused])
        if not staged[stage]:
            continue
        rule_set = pattern.RewriteRuleSet(staged[stage])
        rule_set.apply_to_model(model.clone(), tracer=tracer)  # a new graph; the tensors are shared
        before = _tagged(model.graph)  # nodes from an earlier optimize carry tags too
        rule_set.apply_to_model(model)
        # a replacement goes where the matched root was; a node between the match's inputs and that root
        # which reads a kept output (a Shape of the residual sum) then comes before its producer
        model.graph.sort()
        after = _tagged(model.graph)
        for name in {owners[id(r)].name for r in staged[stage]}:
            matched[name] = max(0, after[name] - before[name])
    if progress:
        progress(len(staged), len(staged), "done")
    stats = tracer.finish()
    for name, st in stats.items():
        st.matched = matched.get(name, 0)
    return {**stats, **ran}
