"""Stamps the CUDA major into the package version as a local label: 0.1.0 -> 0.1.0+cu130.

    python ci/set_local_version.py 13.0

Release wheels of each CUDA major are separate files of one version; the label tells pip users
and ``aotinfer info`` which one is installed. Edits python/aotinfer/_version.py in place.
"""

import re
import sys
from pathlib import Path

VERSION_FILE = Path(__file__).resolve().parent.parent / "python/aotinfer/_version.py"


def main() -> None:
    if len(sys.argv) != 2 or not re.fullmatch(r"\d+\.\d+", sys.argv[1]):
        sys.exit("usage: set_local_version.py CUDA_VERSION   (like 12.9 or 13.0)")
    label = "cu" + sys.argv[1].replace(".", "")
    text = VERSION_FILE.read_text()
    version = re.search(r'__version__ = "([^"+]+)(\+[^"]*)?"', text).group(1)
    VERSION_FILE.write_text(re.sub(r'__version__ = "[^"]*"', f'__version__ = "{version}+{label}"', text))
    print(f"{version}+{label}")


if __name__ == "__main__":
    main()
