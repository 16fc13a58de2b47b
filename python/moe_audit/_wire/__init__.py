"""The protocol's wire codecs (docs/PROTOCOL.md), private: the adapter picks one by protocol.

``v1``: moe-audit/1, JSON lines both ways; ``v2``: moe-audit/2, binary frames.
"""
