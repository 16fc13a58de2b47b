"""A toy model over moe-audit/3 for the whole-model tests (standard library only).

Two MoE layers, 4 experts, top 1, dropless: layer 1 routes token id + 1 mod 4; layer 2 routes
(token id + the previous token's id) mod 4, causal. The first argument picks a behaviour:
`ok`; `leaky` (layer 2 adds the sequence's last token id: a leak first seen at layer 2);
`missing` (responses leave layer 2 out); `changing` (the second response leaves it out);
`bytes` (the header's byte count is off by 7); `nomoe` (a handshake with no MoE layer).
"""
import json
import struct
import sys

E, V = 4, 50
how = sys.argv[1] if len(sys.argv) > 1 else "ok"
layers = [{"layer": 0, "kind": "dense"}]
if how != "nomoe":
    layers += [{"layer": l, "kind": "moe", "experts": E, "top_k": 1} for l in (1, 2)]
hello = {"protocol": "moe-audit/3", "name": f"toy-{how}", "vocab": V, "layers": layers,
         "outputs": 0, "logits": False, "padding_mask": True, "generate": True}
print(json.dumps(hello), flush=True)
stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
calls = 0
while True:
    line = stdin.readline()
    if not line:
        break
    header = json.loads(line)
    payload = stdin.read(header["bytes"])
    b, s = header["batch"], header["seq_len"]
    t = b * s
    ids = struct.unpack(f"<{t}I", payload[: 4 * t])
    calls += 1
    routed = [l for l in layers if l["kind"] != "dense"]
    if how == "missing" or (how == "changing" and calls == 2):
        routed = routed[:1]
    body, listed = b"", []
    for l in routed:
        if l["layer"] == 1:
            experts = [(i + 1) % E for i in ids]
        else:
            prev = [ids[k - 1] if k % s else 0 for k in range(t)]
            last = [ids[(k // s) * s + s - 1] if how == "leaky" else 0 for k in range(t)]
            experts = [(ids[k] + prev[k] + last[k]) % E for k in range(t)]
        body += struct.pack(f"<{t}I", *[1] * t) + struct.pack(f"<{t}i", *experts)
        body += struct.pack(f"<{t}f", *[1.0] * t) + bytes([1] * t)
        listed.append({"layer": l["layer"], "routes": t, "capacity": None})
    size = len(body) + (7 if how == "bytes" else 0)
    stdout.write((json.dumps({"id": header["id"], "layers": listed, "bytes": size}) + "\n").encode() + body)
    stdout.flush()
