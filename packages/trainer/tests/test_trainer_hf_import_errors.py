"""Starting from Hugging Face weights of another model or size is one line before the model is
built, naming the model.name / model.flavor to set (issue 13.11); only config.json is read."""

import json

import pytest

from plait.models import get_model_spec
from plait.trainer.config import ConfigError, build_config
from plait.trainer.validate import validate


def hf_folder(tmp_path, model, flavor, **changes):
    spec = get_model_spec(model)
    config = spec.hf_adapter.hf_config(spec.flavors[flavor])
    config.update(changes)
    folder = tmp_path / f"{model}-{flavor}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def check(folder, *overrides):
    return validate(build_config(None, [("checkpoint.initial_load_path", folder),
                                        ("checkpoint.initial_load_hf", "true"), *overrides]), 1)


def test_wrong_model_name_and_flavor(tmp_path):
    llama = hf_folder(tmp_path, "llama3", "debugmodel")
    deepseek = hf_folder(tmp_path, "deepseek_v3", "671B")
    assert check(llama).model_args == get_model_spec("llama3").flavors["debugmodel"]
    with pytest.raises(ConfigError, match="holds a LlamaForCausalLM model, not deepseek_v3: set model.name = llama3"):
        check(llama, ("model.name", "deepseek_v3"))
    with pytest.raises(ConfigError, match="holds a DeepseekV3ForCausalLM model, not llama3: set model.name = deepseek_v3"):
        check(deepseek)
    with pytest.raises(ConfigError, match=r"is not llama3 1B \(differs in dim.*\): set model.flavor = debugmodel"):
        check(llama, ("model.flavor", "1B"), ("training.seq_len", "64"))
    odd = hf_folder(tmp_path, "llama3", "1B", num_hidden_layers=3)
    with pytest.raises(ConfigError, match="set model.flavor \\(or the model.\\* sizes\\) to match it"):
        check(odd, ("model.flavor", "1B"), ("training.seq_len", "64"))
    config = json.loads((tmp_path / "deepseek_v3-671B" / "config.json").read_text())
    del config["kv_lora_rank"]
    (tmp_path / "deepseek_v3-671B" / "config.json").write_text(json.dumps(config))
    broken = deepseek
    with pytest.raises(ConfigError, match="cannot be read as deepseek_v3 \\('kv_lora_rank'\\)"):
        check(broken, ("model.name", "deepseek_v3"), ("model.flavor", "671B"), ("training.seq_len", "64"))
