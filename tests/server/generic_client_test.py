#!/usr/bin/python3
"""Health and reflection answered to a generic gRPC client.

Starts the attnserve binary on an ephemeral loopback port and talks to it with Python grpcio,
using no generated code of ours: the health check and the reflection requests are encoded by
hand, and GetServerInfo is called with message classes built from the descriptors that
reflection returned. Exits 77 (skipped) when grpcio or protobuf are not installed.
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

try:
    import grpc
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
except ImportError as e:  # Debian: apt-get install python3-grpcio python3-protobuf
    print(f"skipped: {e}")
    sys.exit(77)


def varint(value):
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number, payload):
    """A length-delimited protobuf field."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def parse(buf):
    """Yields (field number, wire type, value) of one protobuf message."""
    i = 0
    while i < len(buf):
        key, i = read_varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = read_varint(buf, i)
        elif wire == 2:
            length, i = read_varint(buf, i)
            value, i = buf[i:i + length], i + length
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        else:
            raise ValueError(f"wire type {wire}")
        yield number, wire, value


def read_varint(buf, i):
    shift = result = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return result, i


def identity(x):
    return x


def reflect(channel, request):
    call = channel.stream_stream(
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        request_serializer=identity, response_deserializer=identity)
    return list(call(iter([request]), timeout=10))[0]


def main():
    binary = sys.argv[1]
    workdir = tempfile.mkdtemp(prefix="attnserve_generic_")
    port_file = os.path.join(workdir, "port")
    server = subprocess.Popen([binary, "--listen=127.0.0.1:0", f"--port_file={port_file}",
                               "--cpu_threads=1"], stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 20
        while not os.path.exists(port_file):
            if time.time() > deadline or server.poll() is not None:
                print("server did not start")
                return 1
            time.sleep(0.05)
        port = int(open(port_file).read())
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")

        # grpc.health.v1.Health/Check, overall and for our service: status field 1, SERVING = 1.
        check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                    request_serializer=identity, response_deserializer=identity)
        for service in (b"", b"attnserve.v1.AttentionService"):
            reply = check(field(1, service) if service else b"", timeout=10)
            status = dict((n, v) for n, _, v in parse(reply)).get(1, 0)
            assert status == 1, f"health of {service!r}: status {status}"

        # Reflection: list_services (field 7).
        reply = reflect(channel, field(7, b""))
        services = []
        for n, _, v in parse(reply):
            if n == 6:  # list_services_response
                for m, _, s in parse(v):
                    if m == 1:
                        services.append(dict((k, x) for k, _, x in parse(s))[1].decode())
        print("services:", services)
        for wanted in ("attnserve.v1.AttentionService", "grpc.health.v1.Health",
                       "grpc.reflection.v1alpha.ServerReflection"):
            assert wanted in services, f"{wanted} not listed"

        # file_containing_symbol (field 4) -> FileDescriptorProtos (response field 4, field 1).
        reply = reflect(channel, field(4, b"attnserve.v1.AttentionService"))
        pool = descriptor_pool.DescriptorPool()
        files = [descriptor_pb2.FileDescriptorProto.FromString(bytes(fd))
                 for n, _, v in parse(reply) if n == 4
                 for m, _, fd in parse(v) if m == 1]
        assert files, "no file descriptors for attnserve.v1.AttentionService"
        for fdp in files:
            pool.Add(fdp)
        service = pool.FindServiceByName("attnserve.v1.AttentionService")
        method = service.methods_by_name["GetServerInfo"]
        request_class = message_factory.GetMessageClass(method.input_type) \
            if hasattr(message_factory, "GetMessageClass") \
            else message_factory.MessageFactory(pool).GetPrototype(method.input_type)
        reply_class = message_factory.GetMessageClass(method.output_type) \
            if hasattr(message_factory, "GetMessageClass") \
            else message_factory.MessageFactory(pool).GetPrototype(method.output_type)
        info_call = channel.unary_unary("/attnserve.v1.AttentionService/GetServerInfo",
                                        request_serializer=lambda m: m.SerializeToString(),
                                        response_deserializer=reply_class.FromString)
        info = info_call(request_class(), timeout=10)
        print("GetServerInfo via reflection:", list(info.engines), "gpu =", info.gpu)
        assert "cpu_tiled" in info.engines
        assert info.limits.max_message_bytes > 4 * 1024 * 1024
        channel.close()
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)
    assert code == 0, f"server exit status {code}"
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
