"""``python -m quads_jax.sample``: generate a completion with the rollout engine.

    python -m quads_jax.sample --hf DIR --prompt "Hello" [--precision nvfp4_rac]
    python -m quads_jax.sample --checkpoint DIR --prompt "12+34=" --greedy

    python -m quads_jax.sample --hf DIR --prompts-file prompts.txt --decode-rows 64 --out out.jsonl

``--hf DIR``: a transformers Qwen3-MoE directory (``config.json``, ``*.safetensors`` and the
tokenizer files). ``--checkpoint DIR``: a params-only checkpoint: ``DIR/config.json`` (the HF
model config) and ``DIR/params`` (an Orbax checkpoint of the parameter tree); its tokenizer is
the HF one when ``DIR`` holds tokenizer files, else the built-in character tokenizer of the
synthetic tasks. ``--checkpoint RUN_DIR`` also takes a ``quads_jax.train`` run directory (what
``make demo`` leaves in ``runs/tiny_cpu``): the params of its latest complete checkpoint, or of
``--step N``, with the run's tokenizer. The weights are synced to ``--precision`` (and checked
bit for bit), the prompt is generated ``--n`` times, and the completion is printed with
tokens/s (compilation timed apart).

``--prompts-file FILE``: one prompt per line (a line that is a JSON object gives its
``"prompt"``; empty lines are skipped), all sampled ``--n`` times. ``--decode-rows N`` decodes
them on N rows with continuous batching (``sampler.generate_continuous``; its time then
includes compilation); ``--out FILE`` writes one JSON line per sample (prompt index, prompt,
completion, response tokens, finish reason) instead of printing the completions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

from quads_jax import xla_runtime
from quads_jax.quant.recipe import ROLLOUT_PRECISIONS as PRECISIONS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m quads_jax.sample", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", metavar="DIR", help="transformers Qwen3-MoE directory")
    src.add_argument("--checkpoint", metavar="DIR",
                     help="params-only checkpoint directory, or a quads_jax.train run directory")
    p.add_argument("--step", type=int, default=None,
                   help="with --checkpoint RUN_DIR: that checkpoint step (default: the latest)")
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", help="prompt text")
    text.add_argument("--prompts-file", metavar="FILE",
                      help="prompts, one per line (or JSON lines with a 'prompt' key)")
    p.add_argument("--decode-rows", type=int, default=0,
                   help="continuous batching on this many decode rows (0: one batch)")
    p.add_argument("--segment-steps", type=int, default=32,
                   help="with --decode-rows: decode steps between refills")
    p.add_argument("--out", metavar="FILE", help="write the samples as JSON lines here")
    p.add_argument("--share-prompt-cache", action="store_true",
                   help="the --n samples of a prompt share one copy of its KV cache")
    p.add_argument("--precision", choices=sorted(PRECISIONS), default="bf16")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--greedy", action="store_true", help="argmax decoding")
    p.add_argument("--sampler", choices=("gumbel", "inverse_cdf"), default="inverse_cdf",
                   help="how a token is drawn from its log-probs (sampling.SAMPLERS)")
    p.add_argument("--n", type=int, default=1, help="samples of the prompt")
    p.add_argument("--seed", type=int, default=0)
    xla_runtime.add_autotune_cache_argument(p)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="compute dtype")
    p.add_argument("--kv-cache-dtype", default="model",
                   help="the KV cache: model, bfloat16, float32 or float8_e4m3fn (FP8 halves its "
                   "bytes); SamplerConfig.kv_cache_dtype checks it")
    return p


class _HFTokenizer:
    """The CharTokenizer's interface over a transformers tokenizer."""

    def __init__(self, tok):
        self.tok = tok
        self.eos_id = tok.eos_token_id
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text))

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


class _CharPromptTokenizer:
    """The character tokenizer with BOS first, as the synthetic tasks' prompts are encoded."""

    def __init__(self, tok):
        self.tok, self.eos_id, self.pad_id = tok, tok.eos_id, tok.pad_id

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_bos=True)

    def decode(self, ids) -> str:
        return self.tok.decode(ids)


def _has_tokenizer_files(path: str) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    return any(os.path.exists(os.path.join(path, n)) for n in names)


def is_train_run(path: str) -> bool:
    """A ``quads_jax.train`` run directory (its configs and a ``checkpoints`` folder)."""
    return all(os.path.exists(os.path.join(path, n))
               for n in ("config.json", "model_config.json", "checkpoints"))


def _run_tokenizer_dir(path: str) -> str | None:
    """The HF tokenizer directory a train run used, or None for the character tokenizer."""
    with open(os.path.join(path, "config.json")) as f:
        name = json.load(f).get("model", {}).get("tokenizer", "char")
    return None if name == "char" else name


def load_model(args) -> tuple:
    """``(model_config, params, tokenizer)`` from ``--hf`` or ``--checkpoint``."""
    from quads_jax import models
    from quads_jax.tokenizers import CharTokenizer, load_hf_tokenizer

    path = args.hf or args.checkpoint
    if not os.path.isdir(path):
        raise ValueError(f"{'--hf' if args.hf else '--checkpoint'}: {path!r} is not a directory")
    run = bool(args.checkpoint) and is_train_run(path)
    if args.step is not None and not run:
        raise ValueError(f"--step={args.step}: applies to --checkpoint RUN_DIR (a "
                         f"quads_jax.train run directory) only; {path!r} is not one")
    tokenizer_dir = path
    if args.hf:
        config, params = models.load_hf(path)
    elif run:
        from quads_jax.export import restore_params

        config, params, _ = restore_params(path, args.step)
        tokenizer_dir = _run_tokenizer_dir(path)
    else:
        import orbax.checkpoint as ocp

        config = models.read_config(path)
        params_dir = os.path.join(os.path.abspath(path), "params")
        if not os.path.isdir(params_dir):
            raise ValueError(f"--checkpoint: {path!r} has no 'params' Orbax checkpoint folder")
        abstract = jax.eval_shape(lambda: models.init_params(config, jax.random.key(0)))
        params = ocp.StandardCheckpointer().restore(params_dir, abstract)
    config = config.replace(dtype=args.dtype)
    if tokenizer_dir is not None and _has_tokenizer_files(tokenizer_dir):
        tokenizer = _HFTokenizer(load_hf_tokenizer(tokenizer_dir))
    else:
        tokenizer = _CharPromptTokenizer(CharTokenizer())
    return config, params, tokenizer


def read_prompts(args) -> list[str]:
    """The prompt texts of ``--prompt`` or ``--prompts-file``."""
    if args.prompts_file is None:
        return [args.prompt]
    if not os.path.isfile(args.prompts_file):
        raise ValueError(f"--prompts-file: {args.prompts_file!r} is not a file")
    prompts = []
    with open(args.prompts_file) as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                try:
                    line = json.loads(line)["prompt"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"--prompts-file: line {number} is a JSON object without a "
                                     f"string 'prompt' ({type(e).__name__})") from None
                if not isinstance(line, str):
                    raise ValueError(f"--prompts-file: line {number}: 'prompt' is not a string")
            prompts.append(line)
    if not prompts:
        raise ValueError(f"--prompts-file: {args.prompts_file!r} holds no prompt")
    return prompts


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from quads_jax.quant.recipe import get_recipe
    from quads_jax.sampler import SamplerConfig, check_sync, sync
    from quads_jax.sampler.continuous import generate_continuous
    from quads_jax.sampler.engine import FINISH_STOP, compile_generate, left_pad

    try:
        if args.autotune_cache is not None:
            xla_runtime.use_autotune_cache(args.autotune_cache)
        texts = read_prompts(args)
        for flag, value, low in (("--decode-rows", args.decode_rows, 0),
                                 ("--segment-steps", args.segment_steps, 1)):
            if value < low:
                raise ValueError(f"{flag}={value}: must be >= {low}")
        if args.decode_rows and args.decode_rows < args.n:
            raise ValueError(f"--decode-rows={args.decode_rows}: must hold one group of --n="
                             f"{args.n} samples (or be 0)")
        config, params, tokenizer = load_model(args)
        stops = () if tokenizer.eos_id is None else (int(tokenizer.eos_id),)
        sc = SamplerConfig(max_new_tokens=args.max_new_tokens, n_samples=args.n,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                           greedy=args.greedy, sampler=args.sampler, stop_token_ids=stops,
                           pad_token_id=int(tokenizer.pad_id),
                           kv_cache_dtype=args.kv_cache_dtype,
                           share_prompt_cache=args.share_prompt_cache)
        prompts, mask = left_pad([tokenizer.encode(t) for t in texts], sc.pad_token_id)
        room = config.max_position_embeddings - prompts.shape[1]
        if args.max_new_tokens > room:
            raise ValueError(
                f"--max-new-tokens={args.max_new_tokens}: the longest prompt ({prompts.shape[1]} "
                f"tokens) leaves room for {max(room, 0)} in the model's context "
                f"(max_position_embeddings={config.max_position_embeddings}); pass "
                f"--max-new-tokens <= {max(room, 0)} or a shorter prompt")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    recipe = get_recipe(PRECISIONS[args.precision])
    t0 = time.perf_counter()
    rollout_params = jax.block_until_ready(sync(params, recipe, model_config=config))
    t1 = time.perf_counter()
    check_sync(params, rollout_params, recipe, model_config=config)
    rng = jax.random.key(args.seed)
    if args.decode_rows:
        t2 = time.perf_counter()
        out, segments = generate_continuous(
            rollout_params, prompts, rng, sc, model_config=config, recipe=recipe,
            prompt_mask=mask, batch_rows=args.decode_rows, segment_steps=args.segment_steps)
        out = jax.block_until_ready(out)
        how = f"{len(segments)} segments on {segments[0].rows} rows, compilation included"
    else:
        run = compile_generate(rollout_params, prompts, rng, sc, model_config=config,
                               recipe=recipe, prompt_mask=mask)
        t2 = time.perf_counter()
        out = jax.block_until_ready(run(rollout_params, prompts, mask, rng))
        how = f"compile {t2 - t1:.1f} s"
    t3 = time.perf_counter()
    # One read-back of the rollout, not a device read per sample and field.
    tokens, lengths, finish_reason, prompt_index = (np.asarray(a) for a in jax.device_get(
        (out.tokens, out.response_length, out.finish_reason, out.prompt_index)))
    new_tokens = int(lengths.sum())
    width = out.prompt_length
    records = []
    for row, length in enumerate(lengths.tolist()):
        text = tokenizer.decode(tokens[row, width:width + length].tolist())
        finish = "stop" if finish_reason[row] == FINISH_STOP else "length"
        prompt = texts[prompt_index[row]]
        if args.out:
            records.append(json.dumps(dict(prompt_index=int(prompt_index[row]), prompt=prompt,
                                           completion=text, tokens=length, finish=finish)))
        else:
            print(f"--- sample {row} ({length} tokens, finish={finish})")
            print(prompt + text)
    if args.out:
        with open(args.out, "w") as f:
            f.write("".join(r + "\n" for r in records))
        print(f"--- {len(records)} samples written to {args.out}")
    print(f"--- {args.precision}: {new_tokens} tokens in {t3 - t2:.3f} s = "
          f"{new_tokens / max(t3 - t2, 1e-9):.1f} tokens/s (sync {t1 - t0:.2f} s, {how}, "
          f"device {jax.devices()[0].platform})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
