"""The rollout engine: sampling, the jitted prefill + decode loop, and the weight sync."""

from quads_jax.sampler.calibration import calibrate
from quads_jax.sampler.compaction import generate_compacting
from quads_jax.sampler.continuous import generate_continuous
from quads_jax.sampler.engine import (
    FINISH_LENGTH,
    FINISH_STOP,
    DecodeState,
    Rollout,
    SamplerConfig,
    decode,
    finish,
    generate,
    left_pad,
    prefill,
)
from quads_jax.sampler.sampling import SamplingParams, sample_tokens
from quads_jax.sampler.sync import SyncMismatchError, check_sync, sync, weight_bytes

__all__ = [
    "FINISH_LENGTH",
    "FINISH_STOP",
    "DecodeState",
    "Rollout",
    "SamplerConfig",
    "SamplingParams",
    "SyncMismatchError",
    "calibrate",
    "check_sync",
    "decode",
    "finish",
    "generate",
    "generate_compacting",
    "generate_continuous",
    "left_pad",
    "prefill",
    "sample_tokens",
    "sync",
    "weight_bytes",
]
