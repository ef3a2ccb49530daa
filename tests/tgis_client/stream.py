"""A TGIS client built from caikit-tgis-backend, run with the venv of tests/tgis_client/setup_venv.sh.

It connects the way a caikit runtime does (a remote `TGISBackend` with connection testing,
which calls ModelInfo), then streams one greedy generation with GenerateStream, runs the same
prompt through the unary Generate and tokenizes it. It prints one JSON object on stdout: the
messages as dicts (proto field names), the streamed text, and the descriptor of the
generation.proto that caikit-tgis-backend ships, so the test can compare it with ours.
"""

import argparse
import base64
import json

from caikit_tgis_backend import TGISBackend
from caikit_tgis_backend.protobufs import generation_pb2
from google.protobuf.json_format import MessageToDict


def as_dict(message):
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True, help="host:port of the TGIS server")
    parser.add_argument("--model-id", default="tgis-client-model")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=12)
    args = parser.parse_args()

    backend = TGISBackend({"connection": {"hostname": args.address}, "test_connections": True, "connect_timeout": 30})
    client = backend.get_client(args.model_id)

    params = generation_pb2.Parameters(
        method=generation_pb2.GREEDY,
        stopping=generation_pb2.StoppingCriteria(max_new_tokens=args.max_new_tokens),
        response=generation_pb2.ResponseOptions(generated_tokens=True, input_tokens=True),
    )
    stream = client.GenerateStream(
        generation_pb2.SingleGenerationRequest(
            model_id=args.model_id, request=generation_pb2.GenerationRequest(text=args.prompt), params=params
        ),
        timeout=120,
    )
    messages = list(stream)
    unary = client.Generate(
        generation_pb2.BatchedGenerationRequest(
            model_id=args.model_id, requests=[generation_pb2.GenerationRequest(text=args.prompt)], params=params
        ),
        timeout=120,
    )
    tokenized = client.Tokenize(
        generation_pb2.BatchedTokenizeRequest(
            model_id=args.model_id, requests=[generation_pb2.TokenizeRequest(text=args.prompt)], return_tokens=True
        ),
        timeout=30,
    )
    info = client.ModelInfo(generation_pb2.ModelInfoRequest(model_id=args.model_id), timeout=30)
    print(
        json.dumps(
            {
                "model_info": as_dict(info),
                "stream": [as_dict(m) for m in messages],
                "stream_text": "".join(m.text for m in messages),
                "generate": as_dict(unary),
                "tokenize": as_dict(tokenized),
                "descriptor": base64.b64encode(generation_pb2.DESCRIPTOR.serialized_pb).decode(),
            }
        )
    )


if __name__ == "__main__":
    main()
