"""What the gateway and the workers must agree on: wire protocol, configuration, errors, paths."""
