"""Test stand-in for ``torch_neuronx.proto.metaneff_pb2``: the ``MetaNeff`` message a ModelBuilder bucket's
``metaneff.pb`` holds (its ``.proto`` is not public).

The names are the ones NxD's and NxDI's public code read and write: ``MetaNeff.input_tensors`` /
``output_tensors``, ``MetaTensor.name`` / ``shape`` / ``data_type`` / ``type`` / ``checkpoint_key`` and
``MetaTensor.Type.USER_INPUT`` / ``INPUT_STATE`` / ``INPUT_WEIGHT`` (NxD v2.28.0 trace/hlo_utils.py ~465-472,
model_builder.py ~996-1031; NxDI utils/snapshot.py ~361-372). The field numbers of ``name``, ``shape`` and
``data_type`` are those of the last public copy (torch-neuronx 1.x ``proto/metaneff_pb2.py``); ``type`` and
``checkpoint_key`` came later and their numbers are not public: these are the stand-in's own, so a stand-in file and a
real one are not interchangeable, which nothing needs (each is read by its own SDK's class).
"""

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_FILE = descriptor_pb2.FileDescriptorProto(name="fake_metaneff.proto", package="metaneff", syntax="proto3")
_tensor = _FILE.message_type.add(name="MetaTensor")
_type = _tensor.enum_type.add(name="Type")
for _number, _name in enumerate(("UNKNOWN", "USER_INPUT", "INPUT_STATE", "INPUT_WEIGHT")):
    _type.value.add(name=_name, number=_number)
_F = descriptor_pb2.FieldDescriptorProto
for _name, _number, _kind, _label in (("name", 1, _F.TYPE_BYTES, _F.LABEL_OPTIONAL),
                                      ("shape", 2, _F.TYPE_INT64, _F.LABEL_REPEATED),
                                      ("data_type", 3, _F.TYPE_INT32, _F.LABEL_OPTIONAL),
                                      ("checkpoint_key", 20, _F.TYPE_BYTES, _F.LABEL_OPTIONAL)):
    _tensor.field.add(name=_name, number=_number, type=_kind, label=_label)
_tensor.field.add(name="type", number=21, type=_F.TYPE_ENUM, label=_F.LABEL_OPTIONAL,
                  type_name=".metaneff.MetaTensor.Type")
_neff = _FILE.message_type.add(name="MetaNeff")
for _name, _number in (("input_tensors", 1), ("output_tensors", 2)):
    _neff.field.add(name=_name, number=_number, type=_F.TYPE_MESSAGE, label=_F.LABEL_REPEATED,
                    type_name=".metaneff.MetaTensor")

_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_FILE)
MetaTensor = message_factory.GetMessageClass(_POOL.FindMessageTypeByName("metaneff.MetaTensor"))
MetaNeff = message_factory.GetMessageClass(_POOL.FindMessageTypeByName("metaneff.MetaNeff"))
