"""A test engine that answers with the golden tokens (read from its bundle) and, when asked, damages a
file that is not its own, keeping that file's timestamps, as a careless or hostile engine might.

    tamper_engine.py BEHAVIOUR TARGET --bundle B --mode greedy --output O [--after FILE] [--hold S]

BEHAVIOUR: exact (TARGET ignored) | rewrite (TARGET: another engine's result; its first token is
changed, a real divergence if judged) | flip (TARGET: one byte in its middle is inverted) |
forge (TARGET: another engine's result: first, inside a sandbox, tries to get out as root would
(`umount -l` of results/ and /proc, `mount -o remount,bind,rw /`), then rewrites the result as
`rewrite` does with fresh records beside it: `.sha256`, and `.hmac` too when it can read the
integrity key) | swap (TARGET: a bundle; after the same escape attempt, replaces it in place by a
valid bundle whose golden.p0.tokens[0] differs, creates `--marker` (in the repository), holds it
`--hold` seconds, then restores the original bytes and timestamps: the hashes before and
after the victim's run match).

Whatever it manages, it exits 0 with the exact answer, as a forger would; what it tried and what
came of it is one JSON line on stderr. `--no-key` (forge): leave the key alone, as the
forger of the issue did. `--after FILE` (exact): wait up to 8 s for FILE to exist
before reading the bundle (a victim that reads while a swap holds).
"""
import argparse
import hashlib
import hmac
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))
from k2vec.kdtr import open_bundle  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("behaviour", choices=["exact", "rewrite", "flip", "forge", "swap"])
ap.add_argument("target")
ap.add_argument("--bundle")
ap.add_argument("--mode")
ap.add_argument("--output")
ap.add_argument("--after")
ap.add_argument("--hold", type=float, default=4.0)
ap.add_argument("--marker", default="swapped.marker")
ap.add_argument("--no-key", action="store_true", help="forge: do not look for the integrity key")
args = ap.parse_args()
# Engines run in their own scratch directory: a relative TARGET is relative to the repository.
workdir = os.environ.get("K2VEC_WORKDIR", ".")
target = os.path.join(workdir, args.target)
seen: dict = {"behaviour": args.behaviour}

if args.after:
    deadline = time.monotonic() + 8
    while not os.path.exists(os.path.join(workdir, args.after)) and time.monotonic() < deadline:
        time.sleep(0.02)
    seen["after"] = os.path.exists(os.path.join(workdir, args.after))

with open_bundle(args.bundle) as b:
    n_prompts, vocab = b.metadata["golden"]["prompts"], b.metadata["model"]["vocab_size"]
    prompts = [{"tokens": b[f"golden.p{i}.tokens"].tolist()} for i in range(n_prompts)]
result = {"format": "k2vec-engine-result", "version": 1, "device": "cpu",
          "runs": [{"drafter": None, "prompts": prompts}]}


def escape() -> None:
    """What a hostile engine running as root tries first: undo the sandbox's mounts. Only inside a
    sandbox (results/ is a mount point there): outside one these commands would unmount the host's
    /proc (this engine runs as root in CI), and there is nothing to escape."""
    if not os.path.ismount(os.path.join(workdir, "results")):
        seen["escape"] = "not in a sandbox: nothing tried"
        return
    for cmd in (["umount", "-l", os.path.join(workdir, "results")], ["umount", "-l", "/proc"],
                ["mount", "-o", "remount,bind,rw", "/"]):
        try:
            seen[" ".join(cmd[:2])] = subprocess.run(cmd, capture_output=True).returncode
        except OSError as err:
            seen[" ".join(cmd[:2])] = err.strerror


def attempt(what: str, fn) -> None:
    try:
        fn()
        seen[what] = "done"
    except OSError as err:
        seen[what] = err.strerror


def forge() -> None:
    st = os.stat(target)
    other = json.load(open(target))
    first = other["runs"][0]["prompts"][0]["tokens"]
    first[0] = (first[0] + 1) % vocab
    data = json.dumps(other, indent=1, sort_keys=True).encode()
    with open(target, "wb") as fh:
        fh.write(data)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    name = os.path.basename(target)
    with open(target + ".sha256", "w") as fh:
        fh.write(f"{hashlib.sha256(data).hexdigest()}  {name}\n")
    try:   # the key, where this engine can read it (it can unsandboxed: it runs as the pipeline's user)
        if args.no_key:
            raise OSError(0, "not looked for")
        key = bytes.fromhex(open(os.path.join(workdir, "results", ".integrity.key")).read().strip())
    except OSError as err:
        seen["key"] = err.strerror
    else:
        seen["key"] = "read"
        with open(target + ".hmac", "w") as fh:
            fh.write(f"hmac-sha256:{hmac.new(key, data, hashlib.sha256).hexdigest()}  {name}\n")


def swap() -> None:
    from k2vec.kdtr import write_bundle
    original, st = open(target, "rb").read(), os.stat(target)
    with open_bundle(target) as b:
        tensors = [(n, b[n].copy()) for n in b.keys()]
        meta = b.metadata
    tensors = [(n, (t + 1) % vocab if n == "golden.p0.tokens" else t) for n, t in tensors]
    fake = os.path.join(os.environ["TMPDIR"], "fake.kdtr")
    write_bundle(fake, tensors, meta)
    forged = open(fake, "rb").read()
    seen["same size"] = len(forged) == len(original)
    with open(target, "r+b") as fh:   # in place: the same inode, as every reader has it open
        fh.write(forged)
    marker = os.path.join(workdir, args.marker)   # outside results/: the victim may see it
    try:
        open(marker, "w").close()
        time.sleep(args.hold)
    finally:
        with open(target, "r+b") as fh:
            fh.write(original)
            fh.truncate(len(original))
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.unlink(marker)


if args.behaviour in ("forge", "swap"):
    escape()
    attempt(args.behaviour, forge if args.behaviour == "forge" else swap)
elif args.behaviour != "exact":
    st = os.stat(target)
    if args.behaviour == "rewrite":
        other = json.load(open(target))
        first = other["runs"][0]["prompts"][0]["tokens"]
        first[0] = (first[0] + 1) % vocab
        data = json.dumps(other, indent=1, sort_keys=True).encode()
    else:
        data = bytearray(open(target, "rb").read())
        data[len(data) // 2] ^= 0xFF
    with open(target, "wb") as fh:
        fh.write(data)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))

print(json.dumps(seen), file=sys.stderr)
with open(args.output, "w") as fh:
    json.dump(result, fh)
