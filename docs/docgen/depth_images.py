"""The depth-profile images of the monitors guide, taken from a real run's TensorBoard events.

    python examples/monitors_demo.py --placement both
    python docs/docgen/depth_images.py outputs/monitors_demo docs/img/depth

For every run folder under LOGDIR (monitors_demo writes `post/` and `pre/`) and every image tag the
monitors wrote (`*/depth_profile` ...), the image of the last logged step is written as
`OUT/<run>_<tag>.png`, and `OUT/provenance.json` records where each came from (run, tag, step, the
command), so the guide's images are the monitors' own output, not drawings.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def export(logdir: Path, out: Path, command: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out.mkdir(parents=True, exist_ok=True)
    record: dict = {"command": command, "logdir": str(logdir), "images": []}
    runs = sorted({p.parent for p in logdir.rglob("events.out.tfevents.*")})
    for run in runs:
        acc = EventAccumulator(str(run), size_guidance={"images": 0})
        acc.Reload()
        for tag in sorted(acc.Tags().get("images", [])):
            last = acc.Images(tag)[-1]
            name = f"{run.relative_to(logdir).as_posix().replace('/', '_')}_{re.sub(r'[^A-Za-z0-9]+', '_', tag).strip('_')}.png"
            (out / name).write_bytes(last.encoded_image_string)
            record["images"].append({"file": name, "run": run.relative_to(logdir).as_posix(), "tag": tag, "step": last.step,
                                     "width": last.width, "height": last.height})
    (out / "provenance.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    rec = export(Path(sys.argv[1]), Path(sys.argv[2]), "python examples/monitors_demo.py --placement both")
    print("\n".join(f"{i['file']}: {i['run']} {i['tag']} step {i['step']}" for i in rec["images"]))
