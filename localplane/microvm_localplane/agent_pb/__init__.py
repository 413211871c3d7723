"""The guest agent's gRPC stubs, generated from protos/ by `make proto` (hack/gen_proto.py)."""
