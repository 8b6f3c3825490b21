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
                      "--kv-cache-dtype", "float8_e4m3fn"])
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
    with pytest.raises(SystemExit):
        sample.main(["--hf", hf_dir, "--prompt", "1", "--precision", "int3"])
