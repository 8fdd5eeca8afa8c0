"""Write each given copy of prefill.cuh into its own namespace (aotinfer_NAME) and variants.h,
for bench.cu:  python3 make_variants.py PATH:NAME [PATH:NAME ...]  (the first is the baseline)."""
import sys

names = []
for arg in sys.argv[1:]:
    path, name = arg.rsplit(":", 1)
    text = open(path).read()
    text = text.replace("namespace aotinfer {", f"namespace aotinfer_{name} {{\nusing namespace ::aotinfer;", 1)
    open(f"{name}.cuh", "w").write(text)
    names.append(name)
with open("variants.h", "w") as f:
    f.writelines(f'#include "{n}.cuh"\n' for n in names)
    f.write("#define VARIANTS(X) " + " ".join(f"X({n})" for n in names) + "\n")
