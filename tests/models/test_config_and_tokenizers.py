"""ModelConfig validation and HF dict conversion; the char tokenizer and the HF tokenizer."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from quads_jax.models import ModelConfig
from quads_jax.testing import padded_batch, tiny_config
from quads_jax.tokenizers import CharTokenizer, load_hf_tokenizer


def test_hf_dict_round_trip_and_spellings():
    c = tiny_config(eos_token_id=(2, 5), decoder_sparse_step=2)
    d = c.to_hf_dict()
    assert d["rope_parameters"]["rope_theta"] == c.rope_theta and d["num_experts"] == 8
    assert ModelConfig.from_hf_dict(d) == c
    legacy = dict(d, num_local_experts=8, rope_theta=None)
    legacy.pop("num_experts")
    legacy.pop("head_dim")
    back = ModelConfig.from_hf_dict(legacy)
    assert back.num_experts == 8 and back.rope_theta == c.rope_theta and back.head_dim == 16


def test_layer_kinds_follow_transformers_rule():
    c = tiny_config(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert c.layer_kinds == ("dense", "moe", "dense", "dense", "dense", "moe")
    assert c.num_moe_layers == 2
    assert tiny_config(num_experts=0, mlp_only_layers=()).num_moe_layers == 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(hidden_size=0), "ModelConfig.hidden_size=0"),
    (dict(num_key_value_heads=3), "ModelConfig.num_key_value_heads=3"),
    (dict(num_experts_per_tok=9), "ModelConfig.num_experts_per_tok=9"),
    (dict(mlp_only_layers=(4,)), "ModelConfig.mlp_only_layers"),
    (dict(rms_norm_eps=0.0), "ModelConfig.rms_norm_eps"),
    (dict(head_dim=15), "ModelConfig.head_dim=15"),
    (dict(hidden_act="gelu"), "ModelConfig.hidden_act"),
    (dict(dtype="int8"), "dtype"),
])
def test_config_validation_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**kwargs)


def test_config_is_hashable_static_arg():
    assert hash(tiny_config()) == hash(tiny_config())
    assert tiny_config().dtype == jnp.bfloat16 and tiny_config().param_dtype == jnp.float32


def test_char_tokenizer():
    tok = CharTokenizer()
    text = "Countdown: 3*(4+5)-1 = 26\nAnswer: yes"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and tok.pad_id == 0
    assert max(ids) < tok.vocab_size == len(set(tok.chars)) + 3
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=False).startswith("<bos>C")
    with pytest.raises(ValueError, match="'€' at position 1"):
        tok.encode("1€")
    with pytest.raises(ValueError, match="outside"):
        tok.decode([tok.vocab_size])
    tokens, mask = padded_batch([tok.encode("12"), tok.encode("345")], tok.pad_id)
    assert tokens.tolist()[0][0] == tok.pad_id and mask.tolist() == [[0, 1, 1], [1, 1, 1]]


def test_hf_tokenizer_from_local_dir(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]").save_pretrained(tmp_path)
    hf = load_hf_tokenizer(tmp_path)
    assert hf("hello world")["input_ids"] == [1, 2]
    with pytest.raises(ValueError, match="not a directory"):
        load_hf_tokenizer(tmp_path / "nope")
