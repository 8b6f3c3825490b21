"""HF transformers oracle for the model parity tests (run with the oracle Python: 3.11 + CPU torch).

Usage: ``python scripts/hf_oracle.py JOBS.json OUT.npz``. JOBS.json is a list of jobs:

* ``{"op": "build", "name": N, "dir": D, "config": {...Qwen3MoeConfig kwargs}, "seed": s}``:
  a random ``Qwen3MoeForCausalLM`` (norm weights perturbed too, so a mis-mapped norm shows),
  ``save_pretrained(D)``, then scored like "score";
* ``{"op": "score", "name": N, "dir": D}``: ``from_pretrained(D)``.

Scoring runs the float32 model on ``inputs`` (``tokens``, ``attention_mask``, ``positions``,
int arrays stored in JOBS.json) with eager attention and ``output_router_logits=True``, and
writes ``N/logits`` [B, T, V] float32 and ``N/aux_loss`` to OUT.npz.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
import transformers


def _build(job: dict) -> transformers.PreTrainedModel:
    torch.manual_seed(job.get("seed", 0))
    cfg = transformers.Qwen3MoeConfig(**job["config"])
    model = transformers.Qwen3MoeForCausalLM(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(job["dir"])
    return model


def _score(model, inputs: dict) -> tuple[np.ndarray, float]:
    model.eval()
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(inputs["tokens"], dtype=torch.long),
            attention_mask=torch.tensor(inputs["attention_mask"], dtype=torch.long),
            position_ids=torch.tensor(inputs["positions"], dtype=torch.long),
            output_router_logits=True,
        )
    aux = out.aux_loss
    return out.logits.float().numpy(), float(aux) if aux is not None else 0.0


def main(jobs_path: str, out_path: str) -> None:
    with open(jobs_path) as f:
        spec = json.load(f)
    results = {}
    for job in spec["jobs"]:
        if job["op"] == "build":
            model = _build(job)
        elif job["op"] == "score":
            model = transformers.Qwen3MoeForCausalLM.from_pretrained(
                job["dir"], dtype=torch.float32
            )
        else:
            raise ValueError(f"job op={job['op']!r}: must be 'build' or 'score'")
        model.set_attn_implementation("eager")
        logits, aux = _score(model, spec["inputs"])
        results[f"{job['name']}/logits"] = logits
        results[f"{job['name']}/aux_loss"] = np.float32(aux)
    np.savez(out_path, **results)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
