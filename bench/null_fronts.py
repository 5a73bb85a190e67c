"""The floor of shmserve's front stacks: a gRPC server (grpcio's asyncio server on
uvloop, the gRPC front's stack) and an HTTP server (uvicorn with httptools on uvloop,
the HTTP front's) that answer ModelInfer / POST .../infer of an identity model with the
request's own tensor, with no engine behind them. bench/http_vs_triton.py against
them measures what the client and the server's network stack cost alone: no front
built on these stacks can answer faster.

    python bench/null_fronts.py --grpc-port 29001 --http-port 29000 &
    python bench/http_vs_triton.py --protocol grpc --url null=127.0.0.1:29001 ...
"""
from __future__ import annotations

import argparse
import json
import multiprocessing


def serve_grpc(port: int) -> None:
    import grpc
    import uvloop
    from tritonclient.grpc import service_pb2 as pb

    from shmserve.front.grpc import RAW_OUTPUT_CONTENTS, _field

    async def infer(request, context):
        answer = pb.ModelInferResponse(model_name=request.model_name, model_version="1",
                                       id=request.id)
        answer.outputs.add(name="OUTPUT0", datatype="FP32", shape=request.inputs[0].shape)
        return b"".join([answer.SerializeToString(),
                         *_field(RAW_OUTPUT_CONTENTS, request.raw_input_contents[0])])

    async def main():
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 1 << 30)])
        handlers = {"ModelInfer": grpc.unary_unary_rpc_method_handler(
            infer, request_deserializer=pb.ModelInferRequest.FromString,
            response_serializer=lambda b: b)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "inference.GRPCInferenceService", handlers),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    uvloop.run(main())


async def http_app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    headers = dict(scope["headers"])
    body = bytearray()
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    split = int(headers[b"inference-header-content-length"])
    request = json.loads(body[:split])
    data = bytes(body[split:])
    head = json.dumps({"model_name": "identity", "model_version": "1", "outputs": [
        {"name": "OUTPUT0", "datatype": "FP32", "shape": request["inputs"][0]["shape"],
         "parameters": {"binary_data_size": len(data)}}]}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"application/octet-stream"),
        (b"inference-header-content-length", str(len(head)).encode()),
        (b"content-length", str(len(head) + len(data)).encode())]})
    await send({"type": "http.response.body", "body": head + data})


def serve_http(port: int) -> None:
    import uvicorn

    uvicorn.run(http_app, host="127.0.0.1", port=port, http="httptools", loop="uvloop",
                log_level="warning", access_log=False, proxy_headers=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grpc-port", type=int, default=29001)
    ap.add_argument("--http-port", type=int, default=29000)
    args = ap.parse_args()
    servers = [multiprocessing.Process(target=serve_grpc, args=(args.grpc_port,)),
               multiprocessing.Process(target=serve_http, args=(args.http_port,))]
    for p in servers:
        p.start()
    try:
        for p in servers:
            p.join()
    finally:
        for p in servers:
            p.terminate()


if __name__ == "__main__":
    main()
