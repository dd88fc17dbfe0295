"""Reading a hostile `.nemo` runs none of its code: every gadget is a NemoCheckpointError and leaves no trace.

Gadgets are hand-assembled pickle streams (so each opcode route is exercised exactly), `torch.save`d objects whose
`__reduce__` calls a command, YAML tags, and a tokenizer folder that ships its own Python code. Each one, if run,
would create the file `marker`; each test checks that it does not exist afterwards.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import tarfile
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import metadata as dcp_metadata

from exporter.checkpoint import NemoCheckpoint, NemoCheckpointError
from exporter.llm.tokenizer import TokenizerError, load_tokenizer
from support.archives import (
    METADATA,
    replace_member,
    unicode_op,
    via_global,
    via_inst,
    via_obj,
    via_stack_global,
)
from tools.nemo_writer import write_nemo

# -- pickle opcodes, assembled by hand -------------------------------------------------------------------------


def build_on(module: str, name: str, state: bytes) -> bytes:
    """GLOBAL module name, then BUILD with `state` (opcodes pushing one object): sets attributes on what it names."""
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + state + b"b."


def slot_state(key: str, value: bytes) -> bytes:
    """The BUILD state `(None, {key: value})`: `setattr(target, key, value)`."""
    return b"N}" + unicode_op(key) + value + b"s\x86"


ROUTES = {"global": via_global, "stack_global": via_stack_global, "inst": via_inst, "obj": via_obj}

#: (module, name): what each gadget names. Dotted names through every module the metadata allow-list knows,
#: names those modules hold but the list does not, builtins, and the usual command runners.
TARGETS = [
    ("torch.distributed.checkpoint.metadata", "os.system"),
    ("torch.distributed.checkpoint.metadata", "Metadata.__init__.__globals__"),
    ("torch.distributed.checkpoint.metadata", "os"),
    ("torch.distributed.checkpoint.filesystem", "os.system"),
    ("torch.distributed.checkpoint.filesystem", "FileSystemReader"),
    ("torch.serialization", "os.system"),
    ("torch.serialization", "load"),
    ("torch.serialization", "_get_layout.__globals__"),
    ("torch", "os.system"),
    ("torch", "load"),
    ("torch", "float32.__class__"),
    ("pathlib", "os.system"),
    ("pathlib", "Path"),
    ("builtins", "eval"),
    ("builtins", "exec"),
    ("builtins", "getattr"),
    ("builtins", "__import__"),
    ("builtins", "print"),
    ("__builtin__", "eval"),
    ("os", "system"),
    ("posix", "system"),
    ("subprocess", "getoutput"),
    ("functools", "partial"),
    ("operator", "attrgetter"),
    ("collections", "OrderedDict"),
]


@pytest.fixture(scope="module")
def dist_nemo(tmp_path_factory, tiny_gpt_weights) -> Path:
    """A valid torch_dist `.nemo` (tiny GPT) whose `.metadata` the tests replace."""
    config = {"num_layers": 2, "hidden_size": 16, "ffn_hidden_size": 32, "num_attention_heads": 4,
              "num_query_groups": 2, "kv_channels": 4, "activation": "fast-swiglu", "normalization": "rmsnorm",
              "bias": False}
    return write_nemo(tmp_path_factory.mktemp("dist") / "m.nemo", config, tiny_gpt_weights(config),
                      layout="torch_dist")


def read_with_metadata(dist_nemo: Path, tmp_path: Path, data: bytes) -> None:
    NemoCheckpoint(replace_member(dist_nemo, tmp_path / "gadget.nemo", METADATA, data)).state_dict()


def command_for(name: str, marker: Path) -> str:
    """The argument that makes target `name` create `marker` (Python code for eval/exec, else a shell command)."""
    if name in ("eval", "exec"):
        return f"open({str(marker)!r}, 'w').close()"
    return f"touch {marker}"


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("module, name", TARGETS, ids=[f"{m}:{n}" for m, n in TARGETS])
def test_metadata_gadgets_are_refused(dist_nemo, tmp_path, route, module, name):
    marker = tmp_path / "marker"
    gadget = ROUTES[route](module, name, command_for(name, marker))
    with pytest.raises(NemoCheckpointError, match=r"model_weights/\.metadata.*refusing to unpickle") as error:
        read_with_metadata(dist_nemo, tmp_path, gadget)
    assert name in str(error.value) and "\n" not in str(error.value)
    assert not marker.exists()


def test_the_gadget_would_have_run_without_the_allow_list(tmp_path):
    """The test's gadgets are live: a plain unpickler runs them (so the refusals above are real)."""
    marker = tmp_path / "marker"
    pickle.loads(via_stack_global("os", "system", f"touch {marker}"))
    assert marker.exists()


def test_build_cannot_change_a_class_a_function_or_a_singleton(dist_nemo, tmp_path):
    """BUILD on anything but a fresh instance of an allowed class is refused: no class attribute, no function
    attribute (torch's layout cache), no enum member or dtype changes."""
    gadgets = [
        build_on("torch.distributed.checkpoint.metadata", "Metadata", slot_state("evil", b"K\x01")),
        build_on("torch.distributed.checkpoint.metadata", "TensorProperties", slot_state("__setstate__", b"N")),
        build_on("torch.distributed.checkpoint.filesystem", "_StorageInfo", b"}" + unicode_op("evil") + b"K\x01s"),
        build_on("torch.serialization", "_get_layout", b"}" + unicode_op("cache") + b"}s"),
        build_on("torch", "float32", slot_state("evil", b"K\x01")),
        build_on("pathlib", "PosixPath", slot_state("__fspath__", b"N")),
        # _MEM_FORMAT_ENCODING(0) is the shared CONTIGUOUS member; BUILD would rewrite its value
        b"\x80\x02ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\nK\x00\x85R}"
        + unicode_op("_value_") + b"K\x07sb.",
    ]
    layout_cache = dict(torch.serialization._get_layout.cache)
    for gadget in gadgets:
        with pytest.raises(NemoCheckpointError, match="refusing"):
            read_with_metadata(dist_nemo, tmp_path, gadget)
    assert not hasattr(dcp_metadata.Metadata, "evil") and not hasattr(torch.float32, "evil")
    assert "__setstate__" in vars(dcp_metadata.TensorProperties)
    assert dcp_metadata._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT.value == 0
    assert torch.serialization._get_layout.cache == layout_cache
    assert Path("x").__fspath__() == "x"


@pytest.mark.parametrize("gadget, problem", [
    (b"\x80\x02\x82\x01.", "extension code"),  # EXT1: a registry lookup by number
    (b"\x80\x02" + unicode_op("id") + b"Q.", "persistent id"),  # BINPERSID
    (b"\x80\x02ctorch.serialization\n_get_layout\n" + b"(" + unicode_op("os") + b"tR.", "unknown tensor layout"),
    (b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n" + b"(" + unicode_op("not a dict") + b"tR.",
     "malformed"),
    (pickle.dumps({"state_dict_metadata": {}}), "not a Metadata"),
    (b"\x80\x02ctorch\nSize\n" + b"(" + unicode_op("xyz") + b"tR.", "metadata"),  # torch.Size("xyz"): a TypeError
    (b"garbage" * 10, "not a readable torch_dist metadata"),
])
def test_other_hostile_streams_are_one_clear_error(dist_nemo, tmp_path, gadget, problem):
    with pytest.raises(NemoCheckpointError, match=problem) as error:
        read_with_metadata(dist_nemo, tmp_path, gadget)
    assert "\n" not in str(error.value)


def test_metadata_cannot_point_outside_the_checkpoint(dist_nemo, tmp_path):
    """A well-formed `.metadata` whose storage entries name `../` paths reads nothing outside the archive."""
    with tarfile.open(dist_nemo) as tar:
        metadata = pickle.loads(tar.extractfile("./" + METADATA).read())
    for info in metadata.storage_data.values():
        info.relative_path = "../../../../etc/passwd"
    with pytest.raises(NemoCheckpointError, match="no member 'model_weights/../../../../etc/passwd'"):
        read_with_metadata(dist_nemo, tmp_path, pickle.dumps(metadata))
    folder = tmp_path / "folder"
    with tarfile.open(replace_member(dist_nemo, tmp_path / "p.nemo", METADATA, pickle.dumps(metadata))) as tar:
        tar.extractall(folder, filter="data")
    with pytest.raises(NemoCheckpointError, match="points outside the checkpoint folder"):
        NemoCheckpoint(folder).state_dict()


def test_a_real_metadata_still_reads(dist_nemo, tmp_path):
    """The allow-list is not too narrow: the writer's own `.metadata`, re-pickled at protocol 2 and 5, and with
    the checkpoint folder's path as Python 3.13 pickles it (`pathlib._local.PosixPath`), reads."""
    with tarfile.open(dist_nemo) as tar:
        metadata = pickle.loads(tar.extractfile("./" + METADATA).read())
    assert isinstance(metadata.storage_meta.checkpoint_id, Path)
    expected = NemoCheckpoint(dist_nemo).state_dict()
    python313 = pickle.dumps(metadata, protocol=2).replace(b"cpathlib\nPosixPath\n", b"cpathlib._local\nPosixPath\n")
    assert b"pathlib._local" in python313
    for name, data in {"2": pickle.dumps(metadata, protocol=2), "5": pickle.dumps(metadata, protocol=5),
                       "3.13": python313}.items():
        path = replace_member(dist_nemo, tmp_path / f"p{name}.nemo", METADATA, data)
        got = NemoCheckpoint(path).state_dict()
        assert sorted(got) == sorted(expected) and all(torch.equal(got[k], expected[k]) for k in expected)


# -- legacy weight files: torch.load(weights_only=True) -------------------------------------------------------


class _Reduces:
    """Pickles as `function(*args)`: how a hostile torch.save file smuggles a call."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


def _legacy_gadgets(marker: Path) -> dict[str, object]:
    import functools
    import subprocess

    command = f"touch {marker}"
    return {
        "os.system": _Reduces(os.system, command),
        "eval": _Reduces(eval, f"open({str(marker)!r}, 'w').close()"),
        "subprocess": _Reduces(subprocess.getoutput, command),
        "partial": _Reduces(functools.partial(os.system, command)),
        "nested in a state dict": {"w": torch.zeros(2), "x._extra_state": _Reduces(os.system, command)},
        "defaultdict factory": {"state_dict": _Reduces(__import__("collections").defaultdict, os.system)},
    }


@pytest.mark.parametrize("case", list(_legacy_gadgets(Path("m"))))
def test_legacy_weight_file_gadgets_are_refused(tmp_path, tiny_gpt_config, tiny_gpt_weights, case):
    marker = tmp_path / "marker"
    buffer = io.BytesIO()
    torch.save(_legacy_gadgets(marker)[case], buffer)
    base = write_nemo(tmp_path / "m.nemo", tiny_gpt_config, tiny_gpt_weights(tiny_gpt_config))
    path = replace_member(base, tmp_path / "gadget.nemo", "model_weights.ckpt", buffer.getvalue())
    with pytest.raises(NemoCheckpointError, match="model_weights.ckpt.*refusing to unpickle") as error:
        NemoCheckpoint(path).state_dict()
    assert "\n" not in str(error.value) and "WeightsUnpickler" not in str(error.value)
    assert not marker.exists()


def test_legacy_config_fallback_reads_no_code(tmp_path, tiny_gpt_config, tiny_gpt_weights):
    """Without model_config.yaml the config comes from the weights file's `hyper_parameters`: the same loader."""
    marker = tmp_path / "marker"
    buffer = io.BytesIO()
    torch.save({"state_dict": {}, "hyper_parameters": {"cfg": _Reduces(os.system, f"touch {marker}")}}, buffer)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "model_weights.ckpt").write_bytes(buffer.getvalue())
    with pytest.raises(NemoCheckpointError, match="refusing to unpickle"):
        NemoCheckpoint(folder).config
    assert not marker.exists()


# -- configs: safe YAML and JSON -------------------------------------------------------------------------------


@pytest.mark.parametrize("member, text", [
    ("model_config.yaml", "num_layers: !!python/object/apply:os.system ['touch {marker}']\n"),
    ("model_config.yaml", "!!python/object/new:subprocess.Popen [['touch', '{marker}']]\n"),
    ("model_config.yaml", "- just\n- a list\n"),
])
def test_config_yaml_tags_are_refused(tmp_path, tiny_gpt_config, tiny_gpt_weights, member, text):
    marker = tmp_path / "marker"
    base = write_nemo(tmp_path / "m.nemo", tiny_gpt_config, tiny_gpt_weights(tiny_gpt_config))
    path = replace_member(base, tmp_path / "yaml.nemo", member, text.format(marker=marker).encode())
    with pytest.raises(NemoCheckpointError, match="model_config.yaml") as error:
        NemoCheckpoint(path).config
    assert "\n" not in str(error.value)
    assert not marker.exists()


def test_nemo2_model_yaml_and_dist_metadata_json_are_data_only(tmp_path, tiny_gpt_config, tiny_gpt_weights):
    marker = tmp_path / "marker"
    base = write_nemo(tmp_path / "m.nemo", tiny_gpt_config, tiny_gpt_weights(tiny_gpt_config), layout="nemo2")
    path = replace_member(base, tmp_path / "n2.nemo", "context/model.yaml",
                          f"config: !!python/object/apply:os.system ['touch {marker}']\n".encode())
    with pytest.raises(NemoCheckpointError, match="context/model.yaml is not valid"):
        NemoCheckpoint(path).config
    path = replace_member(base, tmp_path / "json.nemo", "weights/metadata.json", b"{not json")
    with pytest.raises(NemoCheckpointError, match="weights/metadata.json is not valid"):
        NemoCheckpoint(path)
    assert not marker.exists()


# -- tokenizer folders never run their own code ---------------------------------------------------------------


def test_tokenizer_folder_with_remote_code_is_not_run(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "tokenizer"
    words = {"[UNK]": 0, "hello": 1, "world": 2}
    backend = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(folder)
    assert load_tokenizer(None, read_artifact=bytes, tokenizer_path=folder).encode("hello world") == [1, 2]

    marker = tmp_path / "marker"
    (folder / "evil_tokenizer.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": [None, "evil_tokenizer.EvilTokenizer"]})
    config_path.write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="cannot load the Hugging Face tokenizer"):
        load_tokenizer(None, read_artifact=bytes, tokenizer_path=folder)
    assert not marker.exists()
