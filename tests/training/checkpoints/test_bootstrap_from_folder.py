"""`manage.py bootstrap_policy --from PATH`: a local Hugging Face folder of each supported family
(built here, offline, with tiny configs) becomes version 1 through the checkpoint store, and the
torch engine serves it with the folder's own tokenizer and chat template; unsafe folders are refused."""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path

import pytest
import torch
from django.core.management import CommandError, call_command
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from inference.engines import SamplingParams, make_engine
from training.models import PolicyVersion
from training.versions.services import policy_folder

pytestmark = pytest.mark.django_db

SHAPE = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
             intermediate_size=64, max_position_embeddings=128, tie_word_embeddings=False)
FAMILIES = {"qwen2": {}, "qwen3": {}, "llama": {},
            "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)}


def _folder(root: Path, family: str, dense_dir: Path) -> Path:
    folder = root / family
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(dense_dir))
    config = AutoConfig.for_model(family, vocab_size=len(tokenizer), **SHAPE, **FAMILIES[family],
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_folder_of_each_family_becomes_the_served_base(creds, tmp_path, dense_dir, family):
    folder = _folder(tmp_path, family, dense_dir)
    out = StringIO()
    call_command("bootstrap_policy", "--project", creds.project.slug, "--from", str(folder), stdout=out)
    version = PolicyVersion.objects.get(project=creds.project)
    assert version.state == "production" and version.manifest_hash and version.config["model_type"] == family
    served = policy_folder(version)
    assert served != folder  # materialised from the checkpoint store, not read in place
    engine = make_engine("torch", served, version=version.number, max_model_len=64)
    try:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": "def f"}],
                                                    add_generation_prompt=True, tokenize=False)
        assert text.endswith("<|im_start|>assistant\n")  # the folder's own chat template
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
        completion = engine.generate([prompt], n=1, sampling=SamplingParams(max_tokens=4, seed=1))[0]
        assert completion.version == 1 and len(completion.token_ids) >= 1
    finally:
        engine.close()


def _refusal(creds, folder: Path) -> str:
    with pytest.raises(CommandError) as error:
        call_command("bootstrap_policy", "--project", creds.project.slug, "--from", str(folder), stdout=StringIO())
    assert not PolicyVersion.objects.filter(project=creds.project).exists()
    return str(error.value)


def test_unsafe_or_unsupported_folders_are_refused_with_a_fix(creds, tmp_path, dense_dir):
    folder = _folder(tmp_path, "qwen2", dense_dir)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "x.Y"}}))
    assert "remote code" in _refusal(creds, folder)
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    assert "not supported" in _refusal(creds, folder)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04")
    assert "safetensors" in _refusal(creds, folder)
    (folder / "pytorch_model.bin").unlink()
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    tok.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tok))
    for name in ("chat_template.jinja", "chat_template.json"):
        (folder / name).unlink(missing_ok=True)
    assert "chat template" in _refusal(creds, folder)
    assert "config.json" in _refusal(creds, tmp_path / "nowhere")
