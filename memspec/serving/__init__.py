"""The gRPC daemon and its client: servicer, backend, admission, lifecycle, wire format."""
