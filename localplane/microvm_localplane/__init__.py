"""The local control plane: the platform's REST API, port-forward and guest agent on one machine.

It implements ../docs/platform-contract.md and is never more permissive than the platform.
"""
