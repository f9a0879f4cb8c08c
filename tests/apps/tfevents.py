"""Reads TensorBoard event files without TensorFlow or protobuf: the TFRecord
framing (with its masked CRC-32C checked by a bitwise CRC written here) and the
protocol-buffer wire format of Event / Summary / Summary.Value, decoded by hand.
Independent of Chorus's C++ encoder (src/chorus/io/tensorboard.cpp).

    python3 tfevents.py FILE      prints one line per event
"""
import struct
import sys


def crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def masked(data):
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def records(path):
    raw = open(path, "rb").read()
    at = 0
    while at < len(raw):
        assert at + 12 <= len(raw), f"{path}: truncated header at byte {at}"
        (n,) = struct.unpack_from("<Q", raw, at)
        (hcrc,) = struct.unpack_from("<I", raw, at + 8)
        assert hcrc == masked(raw[at:at + 8]), f"{path}: bad length CRC at byte {at}"
        data = raw[at + 12:at + 12 + n]
        (dcrc,) = struct.unpack_from("<I", raw, at + 12 + n)
        assert dcrc == masked(data), f"{path}: bad data CRC at byte {at}"
        yield data
        at += 12 + n + 4


def varint(buf, at):
    shift = value = 0
    while True:
        b = buf[at]
        at += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, at


def fields(buf):
    """(field number, wire type, value) for each field of one message."""
    at = 0
    while at < len(buf):
        key, at = varint(buf, at)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, at = varint(buf, at)
        elif wt == 1:
            v = buf[at:at + 8]
            at += 8
        elif wt == 2:
            n, at = varint(buf, at)
            v = buf[at:at + n]
            at += n
        elif wt == 5:
            v = buf[at:at + 4]
            at += 4
        else:
            raise ValueError(f"wire type {wt}")
        yield num, wt, v


def events(path):
    """Each event as a dict: wall_time, step, file_version, scalars {tag: value}."""
    for data in records(path):
        e = {"wall_time": None, "step": 0, "file_version": None, "scalars": {}}
        for num, wt, v in fields(data):
            if num == 1 and wt == 1:
                e["wall_time"] = struct.unpack("<d", v)[0]
            elif num == 2 and wt == 0:
                e["step"] = v - (1 << 64) if v >= 1 << 63 else v
            elif num == 3 and wt == 2:
                e["file_version"] = v.decode()
            elif num == 5 and wt == 2:
                for snum, swt, value in fields(v):
                    assert snum == 1 and swt == 2, "Summary holds only values"
                    tag, simple = None, None
                    for vnum, vwt, x in fields(value):
                        if vnum == 1 and vwt == 2:
                            tag = x.decode()
                        elif vnum == 2 and vwt == 5:
                            simple = struct.unpack("<f", x)[0]
                    e["scalars"][tag] = simple
        yield e


if __name__ == "__main__":
    for e in events(sys.argv[1]):
        print(e)
