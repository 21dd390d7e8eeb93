"""How long one engine step takes: named step-time models of real GPU deployments.

vLLM runs one forward pass per step over the whole batch, so latency comes from the step time,
not from per-request sleeps. A step costs ``base + prefill_per_token * P +
prefill_per_token_sq * P**2 + decode_per_seq * D + kv_read_per_token * C``, where ``P`` is the
uncached prompt tokens computed in the step, ``D`` the sequences decoding one token and ``C``
the context tokens those sequences attend over: the shape ``shared/reference/vllm.md``
recommends. None of the profiles was measured on a GPU by us: they are derived from published
models (NVIDIA Dynamo's mocker polynomial, BLIS's fitted terms) and from roofline arithmetic,
and each says where its constants come from. Treat absolute numbers as plausible, and
relative effects (batching, long contexts, prefill interference) as what the simulator gets
right.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    """A step-time model plus the deployment defaults that go with it."""

    name: str
    description: str
    source: str
    base_s: float
    prefill_per_token_s: float
    prefill_per_token_sq_s: float
    decode_per_seq_s: float
    kv_read_per_token_s: float
    max_model_len: int
    num_gpu_blocks: int  # with block size 16

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        """Simulated duration of one step (seconds)."""
        return (
            self.base_s
            + self.prefill_per_token_s * prefill_tokens
            + self.prefill_per_token_sq_s * prefill_tokens * prefill_tokens
            + self.decode_per_seq_s * decode_seqs
            + self.kv_read_per_token_s * context_tokens
        )


LLAMA_8B_H100 = Profile(
    name="llama-8b-h100",
    description="Llama-3.1-8B-Instruct, bf16, one H100 SXM 80GB",
    source=(
        "prefill: NVIDIA Dynamo mocker default polynomial (lib/mocker/src/common/perf_model.rs, "
        "quoted in shared/reference/vllm.md C): 1.518e-2 ms/token + 4.21e-7 ms/token^2; its "
        "16.5 ms constant is a whole prefill step and is not added on top of the base. "
        "base: roofline weight read 16 GB / 3.35 TB/s = 4.8 ms, plus BLIS per-layer "
        "32 x 32 us and per-step 126 us = 6.0 ms. per decoding sequence: BLIS per-request "
        "term 4 us. KV read: 128 KiB/token (32 layers x 8 KV heads x 128 dim x 2 x bf16) "
        "/ 3.35 TB/s = 39 ns/token. KV capacity: about 430k tokens at "
        "gpu_memory_utilization 0.9 = 27000 blocks of 16."
    ),
    base_s=6.0e-3,
    prefill_per_token_s=1.518e-5,
    prefill_per_token_sq_s=4.21e-10,
    decode_per_seq_s=4.0e-6,
    kv_read_per_token_s=3.9e-8,
    max_model_len=131072,
    num_gpu_blocks=27000,
)

LLAMA_70B_H100_TP4 = Profile(
    name="llama-70b-h100-tp4",
    description="Llama-3.1-70B-Instruct, bf16, 4 x H100 SXM 80GB, tensor parallel 4",
    source=(
        "scaled from llama-8b-h100 by roofline arithmetic, not measured. base: 140 GB of "
        "weights / 4 GPUs / 3.35 TB/s = 10.4 ms, plus BLIS per-layer 80 x 32 us and "
        "all-reduce overhead, about 14 ms. prefill: the 8B coefficients x 70/8 parameters / 4 "
        "GPUs at the same efficiency (2.19x). KV: 320 KiB/token over 4 GPUs = 24 ns/token. "
        "KV capacity: 4 x 72 GB - 140 GB = about 450k tokens = 28000 blocks of 16."
    ),
    base_s=14.0e-3,
    prefill_per_token_s=3.32e-5,
    prefill_per_token_sq_s=9.2e-10,
    decode_per_seq_s=4.0e-6,
    kv_read_per_token_s=2.4e-8,
    max_model_len=131072,
    num_gpu_blocks=28000,
)

LLAMA_8B_L4 = Profile(
    name="llama-8b-l4",
    description="Llama-3.1-8B-Instruct, bf16, one NVIDIA L4 24GB (small GPU, KV-bound)",
    source=(
        "roofline arithmetic, not measured. base: 16 GB weights / 300 GB/s = 53 ms, plus "
        "BLIS per-layer and per-step terms, about 55 ms. prefill: 16 GFLOP/token at about "
        "50% of 121 TFLOP/s = 0.26 ms/token, with the Dynamo quadratic term scaled by the "
        "same 17x. KV: 128 KiB/token / 300 GB/s = 0.44 us/token. KV capacity: 24 GB x 0.9 - "
        "16 GB weights - activations = about 40k tokens = 2500 blocks of 16; at 8k tokens "
        "per request only a handful fit, so preemption is common."
    ),
    base_s=55.0e-3,
    prefill_per_token_s=2.6e-4,
    prefill_per_token_sq_s=7.2e-9,
    decode_per_seq_s=4.0e-6,
    kv_read_per_token_s=4.4e-7,
    max_model_len=32768,
    num_gpu_blocks=2500,
)

PROFILES: dict[str, Profile] = {p.name: p for p in (LLAMA_8B_H100, LLAMA_70B_H100_TP4, LLAMA_8B_L4)}
DEFAULT_PROFILE = LLAMA_8B_H100.name


def get_profile(name: str) -> Profile:
    """The profile called ``name``; ``KeyError`` lists the known names."""
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}") from None
