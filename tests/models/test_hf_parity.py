"""Logits parity with HF transformers (PyTorch, CPU) through the oracle subprocess, and the
export round trip. Two oracle calls for the whole module: build+score, then score exports."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from quads_jax.models import load_hf, save_hf
from quads_jax.testing import jit_forward, padded_batch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ORACLE_SCRIPT = os.path.join(REPO, "scripts", "hf_oracle.py")
BASE = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
    num_experts_per_tok=2, initializer_range=0.1, rms_norm_eps=1e-6,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
)
CONFIGS = {
    # a dense layer among sparse ones, untied, renormalised top-k
    "untied_norm": dict(BASE, num_hidden_layers=4, mlp_only_layers=[1], norm_topk_prob=True,
                        tie_word_embeddings=False),
    # tied embeddings, no renormalisation, sparsity from decoder_sparse_step
    "tied_nonorm": dict(BASE, num_hidden_layers=3, decoder_sparse_step=2, norm_topk_prob=False,
                        tie_word_embeddings=True),
}


def _oracle_python() -> str:
    exe = os.environ.get("QUADS_ORACLE_PYTHON")
    if not exe:
        cand = os.path.join(REPO, ".venv-oracle", "bin", "python")
        if os.path.exists(cand):
            return cand
        pytest.fail("QUADS_ORACLE_PYTHON is not set and no oracle venv exists (make oracle)")
    return exe


def _run_oracle(tmp, jobs, inputs, tag):
    jobs_path, out_path = os.path.join(tmp, f"{tag}.json"), os.path.join(tmp, f"{tag}.npz")
    with open(jobs_path, "w") as f:
        json.dump({"jobs": jobs, "inputs": inputs}, f)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    proc = subprocess.run([_oracle_python(), ORACLE_SCRIPT, jobs_path, out_path],
                          capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode:
        sys.stderr.write(proc.stderr[-4000:])
        pytest.fail(f"oracle failed (rc={proc.returncode}): {proc.stderr[-1500:]}")
    return dict(np.load(out_path))


def _inputs():
    rng = np.random.default_rng(0)
    rows = [list(rng.integers(3, 96, n)) for n in (9, 6, 4)]
    tokens, mask = padded_batch(rows, left=True)
    tokens[2], mask[2] = 0, False  # row 2 right-padded
    tokens[2, :4], mask[2, :4] = rows[2], True
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    return tokens, mask, positions


def _max_diff(a, b, mask):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b)) * mask[..., None]))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_aux_loss_and_export_round_trip(tmp_path, name):
    """One config per test (xdist runs them in parallel), two oracle calls each."""
    tmp = str(tmp_path)
    tokens, mask, positions = _inputs()
    inputs = {"tokens": tokens.tolist(), "attention_mask": mask.astype(int).tolist(),
              "positions": positions.tolist()}
    src, dst = os.path.join(tmp, name), os.path.join(tmp, f"{name}_export")
    build = {"op": "build", "name": "hf", "dir": src, "config": CONFIGS[name], "seed": 1}
    hf = _run_oracle(tmp, [build], inputs, "build")

    config, params = load_hf(src)
    config = config.replace(dtype=jnp.float32)
    out = jit_forward()(config, params, jnp.asarray(tokens), attention_mask=jnp.asarray(mask))
    assert out.logits.dtype == jnp.float32
    assert np.abs(hf["hf/logits"]).max() > 0.1  # a model that says something
    assert _max_diff(out.logits, hf["hf/logits"], mask) < 1e-4
    np.testing.assert_allclose(float(out.aux_loss), hf["hf/aux_loss"], rtol=1e-5)

    save_hf(config, params, dst)
    exported = _run_oracle(tmp, [{"op": "score", "name": "hf", "dir": dst}], inputs, "export")
    assert _max_diff(exported["hf/logits"], hf["hf/logits"], mask) < 1e-5
    config2, params2 = load_hf(dst)
    assert config2.replace(dtype=jnp.float32) == config
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 params, params2)
