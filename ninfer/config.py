"""Every server option of the contract in one pydantic model; CLI flags and YAML args both land here."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

KV_DTYPES = ("bf16", "int8", "fp8", "nvfp4", "k8v4")
API_KEY_ENV = "NINFER_API_KEY"  # the key from the environment: Ray Serve logs a YAML's `args` in clear


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    artifact: str
    host: str = Field("127.0.0.1", min_length=1)
    port: int = Field(8080, ge=0, le=65535)
    api_key: str | None = Field(None, min_length=1)
    model_id: str | None = Field(None, min_length=1)
    max_context: int = Field(8192, ge=1)
    kv_capacity: int | Literal["auto"] | None = None  # None follows max_context
    max_concurrency: int = Field(1, ge=1, le=8)
    max_pending_requests: int = Field(16, ge=0)
    pending_timeout_ms: int = Field(30000, ge=1)
    prefill_chunk: int = Field(1024, ge=1)
    log_stats_interval_ms: int = Field(5000, ge=0)
    log_level: Literal["trace", "debug", "info", "warning", "error", "critical", "off"] = "info"
    device: int = Field(0, ge=0)
    context_cost_presets: str | None = None
    max_request_mib: int = Field(384, ge=1)
    media_cache_mib: int = Field(1024, ge=0)
    media_live_mib: int = Field(2048, ge=1)
    media_preprocess_threads: int = Field(0, ge=0)
    request_log_jsonl: str | None = None
    response_store_max_records: int = Field(1024, ge=0)
    response_store_max_mib: int = Field(256, ge=0)
    kv_dtype: Literal["bf16", "int8", "fp8", "nvfp4", "k8v4"] = "bf16"
    spec: Literal["mtp", "dflash", "dflash2"] | None = None
    draft_tokens: int | None = Field(None, ge=1, le=15)
    lm_head_draft: bool = False
    default_max_tokens: int = Field(8192, ge=1)
    default_thinking_budget: int | None = Field(None, ge=1)
    vision: bool = False
    no_cuda_graph: bool = False
    no_prefix_reuse: bool = False
    device_state_slots: int | None = Field(None, ge=0)  # None: equal to max_concurrency
    host_context_mib: int | None = Field(None, ge=0)
    no_thinking: bool = False
    preserve_thinking: bool = False
    cors: bool = False
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=20)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # the sampler keys its noise by a signed int64
    greedy: bool = False
    chat_template: str | None = None
    # ninfer (Python) additions: CPU dtype for the embedded default and the KV page size.
    dtype: Literal["auto", "bf16", "fp16", "fp32", "int8"] = "auto"
    page_size: int = Field(16, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _api_key_from_environment(cls, data: Any) -> Any:
        """--api-key / args.api_key when given, else $NINFER_API_KEY (unset or empty: no auth)."""
        if isinstance(data, dict) and "api_key" not in data and os.environ.get(API_KEY_ENV):
            data = {**data, "api_key": os.environ[API_KEY_ENV]}
        return data

    @model_validator(mode="after")
    def _check_spec(self) -> "ServerConfig":
        if self.spec == "mtp" and self.draft_tokens is not None and self.draft_tokens > 5:
            raise ValueError("--draft-tokens for mtp must be 1..5")
        if self.draft_tokens is not None and self.spec is None:
            raise ValueError("--draft-tokens needs --spec")
        if self.lm_head_draft and self.spec is None:
            raise ValueError("--lm-head-draft needs --spec")
        return self

    @model_validator(mode="after")
    def _check_capacity(self) -> "ServerConfig":
        if isinstance(self.kv_capacity, int) and self.kv_capacity < 1:
            raise ValueError("--kv-capacity must be a positive token count or 'auto'")
        return self

    @property
    def state_slots(self) -> int:
        extra = self.max_concurrency if self.device_state_slots is None else self.device_state_slots
        return self.max_concurrency + extra

    @property
    def max_model_len(self) -> int:
        """The prompt + output ceiling a request is validated against before it reaches the engine
        (with auto capacity the engine also checks its resolved pool)."""
        return min(self.max_context, self.resolved_kv_capacity() or self.max_context)

    def resolved_kv_capacity(self) -> int | None:
        """Tokens of the shared KV pool; None for auto, which the engine resolves from free device memory."""
        if self.kv_capacity is None:
            return self.max_context
        if self.kv_capacity == "auto":
            return None
        return self.kv_capacity

    def process_sampling_overrides(self) -> dict[str, float | int]:
        names = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}
