"""``python -m quads_jax.sample`` end to end on a tiny HF checkpoint (character tokenizer)."""

import jax
import pytest

from quads_jax import models, sample
from quads_jax.testing import tiny_config


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    cfg = tiny_config(num_hidden_layers=2, mlp_only_layers=())
    path = tmp_path_factory.mktemp("tiny_hf")
    models.save_hf(cfg, models.init_params(cfg, jax.random.key(0)), str(path))
    return str(path)


def test_cli_prints_completion_and_tokens_per_second(hf_dir, capsys):
    rc = sample.main(["--hf", hf_dir, "--prompt", "12+34=", "--precision", "nvfp4",
                      "--max-new-tokens", "6", "--greedy", "--n", "2",
                      "--kv-cache-dtype", "float8_e4m3fn", "--share-prompt-cache"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("--- sample") == 2 and out.count("12+34=") == 2
    assert "nvfp4:" in out and "tokens/s" in out


def test_cli_errors_name_the_argument(hf_dir, tmp_path, capsys):
    assert sample.main(["--hf", str(tmp_path / "nope"), "--prompt", "1"]) == 2
    assert "--hf" in capsys.readouterr().err
    assert sample.main(["--hf", hf_dir, "--prompt", "1", "--temperature", "0"]) == 2
    assert "temperature=0.0" in capsys.readouterr().err
    assert sample.main(["--hf", hf_dir, "--prompt", "1", "--kv-cache-dtype", "int8"]) == 2
    assert "kv_cache_dtype='int8'" in capsys.readouterr().err
    assert sample.main(["--checkpoint", hf_dir, "--prompt", "1"]) == 2
    assert "no 'params'" in capsys.readouterr().err
    assert sample.main(["--hf", hf_dir, "--prompt", "1", "--step", "3"]) == 2
    assert "--step=3: applies to --checkpoint RUN_DIR" in capsys.readouterr().err
    ctx = models.read_config(hf_dir).max_position_embeddings
    assert sample.main(["--hf", hf_dir, "--prompt", "12", "--max-new-tokens", str(ctx)]) == 2
    assert f"pass --max-new-tokens <= {ctx - 3}" in capsys.readouterr().err  # BOS + "12"
    with pytest.raises(SystemExit):
        sample.main(["--hf", hf_dir, "--prompt", "1", "--precision", "int3"])


def test_cli_samples_a_prompts_file_with_continuous_batching(hf_dir, tmp_path, capsys):
    import json

    prompts = tmp_path / "prompts.txt"
    prompts.write_text('1+2=\n\n{"prompt": "10+20="}\n7+8=\n')
    out = tmp_path / "samples.jsonl"
    rc = sample.main(["--hf", hf_dir, "--prompts-file", str(prompts), "--max-new-tokens", "4",
                      "--n", "2", "--decode-rows", "2", "--segment-steps", "2",
                      "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt_index"] for r in rows] == [0, 0, 1, 1, 2, 2]
    assert [r["prompt"] for r in rows[::2]] == ["1+2=", "10+20=", "7+8="]
    assert all(1 <= r["tokens"] <= 4 and r["finish"] in ("stop", "length") for r in rows)
    assert "6 samples written" in printed and "segments on 2 rows" in printed


def test_cli_refuses_bad_prompt_files_and_rows(hf_dir, tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_text('{"text": "1+2="}\n')
    assert sample.main(["--hf", hf_dir, "--prompts-file", str(bad)]) == 2
    assert "line 1 is a JSON object without a string 'prompt'" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    assert sample.main(["--hf", hf_dir, "--prompts-file", str(empty)]) == 2
    assert "holds no prompt" in capsys.readouterr().err
    assert sample.main(["--hf", hf_dir, "--prompt", "1", "--n", "4", "--decode-rows", "2"]) == 2
    assert "--decode-rows=2: must hold one group of --n=4" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --prompt and --prompts-file exclude each other
        sample.main(["--hf", hf_dir, "--prompt", "1", "--prompts-file", str(bad)])
