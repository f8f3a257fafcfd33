// Records which sources the committed build was made from: sha256 over labextension's
// package.json, src/ and style/ (sorted relative paths, each as "path\0content\0"), written next
// to the built extension. tests/lab/test_build_fresh.py recomputes it without Node, so a change
// to the sources without a rebuild fails the tests.
const crypto = require('crypto');
const fs = require('fs');
const path = require('path');

const root = path.resolve(__dirname, '..');
function files(dir) {
  return fs.readdirSync(path.join(root, dir), { withFileTypes: true }).flatMap(entry => {
    const rel = path.posix.join(dir, entry.name);
    return entry.isDirectory() ? files(rel) : [rel];
  });
}
const all = ['package.json', ...files('src'), ...files('style')].sort();
const hash = crypto.createHash('sha256');
for (const rel of all) {
  hash.update(rel + '\0');
  hash.update(fs.readFileSync(path.join(root, rel)));
  hash.update('\0');
}
const out = path.resolve(root, '..', 'jupyter_gpushare', 'labextension', 'source.sha256');
fs.writeFileSync(out, hash.digest('hex') + '\n');
console.log(`source hash written to ${out}`);
