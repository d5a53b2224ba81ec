"""The message classes protoc generated from proto/attnserve/v1 when this package was built, and
the service's methods read from their descriptor."""
try:
    from attnserve.v1 import attention_pb2 as pb
except ImportError as e:
    if not (e.name or "").startswith("attnserve.v1"):
        raise  # protobuf itself is missing, or too old for the generated code
    raise ImportError(
        "attnserve: the generated message classes (attnserve.v1.attention_pb2) are missing. "
        "They are made from proto/attnserve/v1 when the package is built, so install it rather "
        "than putting clients/python on PYTHONPATH: pip install ./clients/python (on Debian, in a "
        "venv made with --system-site-packages: pip install --no-build-isolation --no-index "
        "./clients/python)") from e

from google.protobuf import descriptor_pb2

SERVICE = pb.DESCRIPTOR.services_by_name["AttentionService"]


class Stub:
    """AttentionService's methods on a grpc.Channel or grpc.aio.Channel, one attribute per rpc.

    Built from the service descriptor rather than by the gRPC Python plugin: the build needs only
    protoc, and an rpc added to the proto needs no code here."""

    def __init__(self, channel):
        factories = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
                     (True, False): channel.stream_unary, (True, True): channel.stream_stream}
        for method in SERVICE.methods:
            shape = descriptor_pb2.MethodDescriptorProto()
            method.CopyToProto(shape)
            request = getattr(pb, method.input_type.name)
            response = getattr(pb, method.output_type.name)
            factory = factories[(shape.client_streaming, shape.server_streaming)]
            setattr(self, method.name,
                    factory(f"/{SERVICE.full_name}/{method.name}",
                            request_serializer=request.SerializeToString,
                            response_deserializer=response.FromString))


def enum_names(enum):
    """{"float32": DTYPE_FLOAT32, ...}: an enum's values by the lower-case name after its prefix,
    the spelling the Python API uses (dtype="bfloat16", path="fused")."""
    return {v.name.split("_", 1)[1].lower(): v.number for v in enum.values
            if not v.name.endswith("_UNSPECIFIED")}
