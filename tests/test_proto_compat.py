"""csrc/rpcenv.proto against TorchBeast's rpcenv.proto: every message, field and RPC that
TorchBeast declares is there with the same number, type and label, so a TorchBeast env server
or client talks to ours. The fields we add are listed below, so that a new one is declared here
on purpose rather than slipped in.

The proto is compiled with grpcio-tools' protoc into a descriptor set and read with
google.protobuf's descriptor_pb2, the way protoc itself sees the file.
"""

import pathlib

import pytest
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

REPO = pathlib.Path(__file__).resolve().parent.parent
PROTO = REPO / "csrc" / "rpcenv.proto"

# TorchBeast's declarations, read from src/proto/rpcenv.proto of facebookresearch/torchbeast at
# commit 0af07b051a2176a8f9fd20c36891ba2bba6bae68 (the file last changed in 52cd16ec21e9).
# message -> field -> (number, type, label); a message type is written by its full name, a
# map field as map<key type, value type>.
TORCHBEAST_PACKAGE = "rpcenv"
TORCHBEAST_SYNTAX = "proto2"
TORCHBEAST_MESSAGES = {
    "Action": {
        "action": (1, "int32", "optional"),
        "nest_action": (2, ".rpcenv.ArrayNest", "optional"),
    },
    "NDArray": {
        "dtype": (1, "int32", "optional"),
        "shape": (2, "int64", "repeated"),
        "data": (3, "bytes", "optional"),
    },
    "ArrayNest": {
        "array": (1, ".rpcenv.NDArray", "optional"),
        "vector": (2, ".rpcenv.ArrayNest", "repeated"),
        "map": (3, "map<string, .rpcenv.ArrayNest>", "repeated"),
    },
    "Step": {
        "observation": (1, ".rpcenv.ArrayNest", "optional"),
        "reward": (2, "float", "optional"),
        "done": (3, "bool", "optional"),
        "episode_step": (4, "int32", "optional"),
        "episode_return": (5, "float", "optional"),
    },
}
# NDArray.shape is declared [packed = true]: its wire encoding, which both sides must share.
TORCHBEAST_PACKED = {("NDArray", "shape")}
# service -> method -> (input type, output type, client streaming, server streaming)
TORCHBEAST_SERVICES = {
    "RPCEnvServer": {
        "StreamingEnv": (".rpcenv.Action", ".rpcenv.Step", True, True),
    },
}

# Our additions (csrc/rpcenv.proto says what each one means); TorchBeast's parsers skip them.
EXTENSION_MESSAGES = {}
EXTENSION_FIELDS = {
    "Step": {
        "game_over": (6, "bool", "optional"),
        "batch": (7, ".rpcenv.ArrayNest", "optional"),
        "extras": (8, ".rpcenv.ArrayNest", "optional"),
        "env_errors": (9, "int64", "optional"),
        "truncated": (10, "bool", "optional"),
    },
}


def compile_proto(proto, out_dir):
    """The FileDescriptorProto of `proto`, as grpcio-tools' protoc compiles it."""
    descriptor_set = out_dir / "rpcenv.desc"
    code = protoc.main(["grpc_tools.protoc", f"--proto_path={proto.parent}",
                        f"--descriptor_set_out={descriptor_set}", str(proto)])
    assert code == 0, f"protoc could not compile {proto} (exit {code})"
    files = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set.read_bytes()).file
    assert len(files) == 1, [f.name for f in files]
    return files[0]


def type_name(field):
    name = descriptor_pb2.FieldDescriptorProto.Type.Name(field.type)
    return field.type_name if field.type_name else name.removeprefix("TYPE_").lower()


def field_table(package, message):
    """field -> (number, type, label) of a DescriptorProto, map fields as map<key, value>."""
    map_entries = {f".{package}.{message.name}.{nested.name}": nested
                   for nested in message.nested_type if nested.options.map_entry}
    table = {}
    for field in message.field:
        label = descriptor_pb2.FieldDescriptorProto.Label.Name(field.label)
        kind = type_name(field)
        entry = map_entries.get(kind)
        if entry is not None:
            key, value = sorted(entry.field, key=lambda f: f.number)
            kind = f"map<{type_name(key)}, {type_name(value)}>"
        table[field.name] = (field.number, kind, label.removeprefix("LABEL_").lower())
    return table


def declared(proto, out_dir):
    """(package, syntax, {message: field table}, {(message, field) packed},
    {service: {method: (input, output, client streaming, server streaming)}}) of `proto`."""
    file = compile_proto(proto, out_dir)
    messages = {m.name: field_table(file.package, m) for m in file.message_type}
    packed = {(m.name, f.name) for m in file.message_type for f in m.field if f.options.packed}
    services = {s.name: {m.name: (m.input_type, m.output_type, m.client_streaming,
                                  m.server_streaming) for m in s.method}
                for s in file.service}
    return file.package, file.syntax or "proto2", messages, packed, services


def compatibility_problems(proto, out_dir):
    """Every way `proto` departs from TorchBeast's declarations plus our listed extensions."""
    package, syntax, messages, packed, services = declared(proto, out_dir)
    problems = []
    if (package, syntax) != (TORCHBEAST_PACKAGE, TORCHBEAST_SYNTAX):
        problems.append(f"package {package!r}, syntax {syntax!r}: TorchBeast's are "
                        f"{TORCHBEAST_PACKAGE!r}, {TORCHBEAST_SYNTAX!r}")
    expected_messages = {**TORCHBEAST_MESSAGES, **EXTENSION_MESSAGES}
    for name in sorted(expected_messages.keys() | messages.keys()):
        if name not in messages:
            problems.append(f"message {name} is missing")
            continue
        if name not in expected_messages:
            problems.append(f"message {name} is not declared in EXTENSION_MESSAGES")
            continue
        expected = {**expected_messages[name], **EXTENSION_FIELDS.get(name, {})}
        for field in sorted(expected.keys() | messages[name].keys()):
            got, want = messages[name].get(field), expected.get(field)
            if got != want:
                where = ("TorchBeast's" if field in expected_messages[name]
                         else "the extension" if want else "undeclared (EXTENSION_FIELDS)")
                problems.append(f"{name}.{field}: {got}, {where}: {want}")
    for message, field in sorted(TORCHBEAST_PACKED - packed):
        problems.append(f"{message}.{field} is not [packed = true]")
    for service, methods in TORCHBEAST_SERVICES.items():
        for method, signature in methods.items():
            got = services.get(service, {}).get(method)
            if got != signature:
                problems.append(f"rpc {service}.{method}: {got}, TorchBeast's: {signature}")
    return problems


def test_rpcenv_proto_keeps_torchbeasts_messages_fields_and_rpc(tmp_path):
    assert compatibility_problems(PROTO, tmp_path) == []


def test_extensions_take_numbers_torchbeast_does_not_use():
    for message, fields in EXTENSION_FIELDS.items():
        used = {number for number, _, _ in TORCHBEAST_MESSAGES.get(message, {}).values()}
        clash = {f: n for f, (n, _, _) in fields.items() if n in used}
        assert not clash, f"{message}: extension fields on TorchBeast's numbers {clash}"
        assert not fields.keys() & TORCHBEAST_MESSAGES.get(message, {}).keys()


@pytest.mark.parametrize("change, problem", [
    (("optional float reward = 2;", "optional float reward = 12;"), "Step.reward"),
    (("optional int32 dtype = 1;", "optional int64 dtype = 1;"), "NDArray.dtype"),
    (("optional bool truncated = 10;", "optional bool truncated = 10;\n  optional int32 x = 11;"),
     "Step.x"),
    (("[packed = true]", ""), "NDArray.shape is not [packed = true]"),
    (("returns (stream Step)", "returns (Step)"), "rpc RPCEnvServer.StreamingEnv"),
], ids=["number", "type", "undeclared-extension", "packed", "rpc"])
def test_a_changed_copy_of_the_proto_is_refused(tmp_path, change, problem):
    """The check reads the file: a copy with one declaration changed fails it, by name."""
    text = PROTO.read_text()
    old, new = change
    assert old in text, f"{PROTO} no longer has {old!r}: update this test's changes"
    copy = tmp_path / "copy" / PROTO.name
    copy.parent.mkdir()
    copy.write_text(text.replace(old, new, 1))
    problems = compatibility_problems(copy, tmp_path)
    assert any(problem in p for p in problems), problems
