"""A moe-audit/2 router that answers its first request with a malformed binary response, chosen
by its argument: short (the payload ends early), bytes (the header's byte count is wrong),
scope (an unknown capacity scope), routes (an absurd route count), kept (a kept flag of 2),
slots (a slot list of the wrong length)."""

import json
import sys

import numpy as np

from moe_audit._wire import v2  # the codec, to write frames a router must not send

KIND = sys.argv[1]
out = sys.stdout.buffer
out.write(json.dumps({"protocol": "moe-audit/2", "name": "bad", "experts": 4, "top_k": 1,
                      "input": "logits", "responses": "binary"}).encode() + b"\n")
out.flush()
req = v2.read_request(sys.stdin.buffer, 4)
b, s, _ = req.data.shape
t = b * s
columns = (np.ones(t), np.zeros(t), np.ones(t), np.ones(t))
capacity = {"scope": "sequence", "slots": [t] * b}
header, payload = v2.response(req.id, columns, capacity, 4)
h = json.loads(header)
if KIND == "short":
    payload = payload[:-3]
elif KIND == "bytes":
    h["bytes"] += 1
elif KIND == "scope":
    h["capacity"]["scope"] = "galaxy"
elif KIND == "routes":
    h["routes"] = 2 ** 62
elif KIND == "kept":
    payload = payload[:-1] + b"\x02"
elif KIND == "slots":
    h["capacity"]["slots"] = [1]
out.write(json.dumps(h).encode() + b"\n" + payload)
out.flush()
if KIND != "short":
    sys.stdin.buffer.read()
