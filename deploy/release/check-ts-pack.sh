#!/usr/bin/env bash
# Checks that the TypeScript client (clients/ts) packs as a publishable npm
# package (run by `make check-ts-pack`): a clean build as prepublishOnly does
# it, then `npm pack --dry-run`, and the packed file list must
#
#   - hold every file package.json points at (main, module, types, exports);
#   - hold nothing but package.json, README/LICENSE files and dist/src/
#     (no tests, no TypeScript sources, no node_modules);
#   - belong to a package that is not private and names its license.
set -euo pipefail
cd "$(dirname "$0")/../../clients/ts"

npm ci --no-audit --no-fund
npm run clean
npm run build
pack=$(mktemp)
trap 'rm -f "$pack"' EXIT
npm pack --dry-run --json >"$pack"
node --input-type=module - "$pack" <<'JS'
import { readFileSync } from "node:fs";

const pkg = JSON.parse(readFileSync("package.json", "utf8"));
const [pack] = JSON.parse(readFileSync(process.argv[2], "utf8"));
const files = new Set(pack.files.map((f) => f.path));
const problems = [];

if (pkg.private) problems.push('package.json says "private": true');
if (!pkg.license) problems.push("package.json names no license");
if (!pkg.scripts?.prepublishOnly) problems.push("package.json has no prepublishOnly script");

const targets = [pkg.main, pkg.module, pkg.types];
const walk = (v) => {
  if (typeof v === "string") targets.push(v);
  else if (v && typeof v === "object") Object.values(v).forEach(walk);
};
walk(pkg.exports);
for (const t of targets.filter(Boolean)) {
  const path = t.replace(/^\.\//, "");
  if (!files.has(path)) problems.push(`${t} (package.json) is not in the package`);
}
for (const f of files) {
  if (!(f === "package.json" || /^(README|LICENSE)/i.test(f) || f.startsWith("dist/src/"))) {
    problems.push(`${f} should not be in the package`);
  }
}
if (problems.length > 0) {
  console.error(`check-ts-pack: ${pack.filename}:\n  ${problems.join("\n  ")}`);
  process.exit(1);
}
console.log(`${pack.filename}: ${pack.entryCount} files, ${pack.size} bytes packed, ${pack.unpackedSize} unpacked; main, module, types and exports all packed`);
JS
