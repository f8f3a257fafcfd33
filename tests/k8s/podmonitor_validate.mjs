// Validates a PodMonitor (JSON on stdin) with the npm package @kubernetes-models/prometheus-operator
// (installed in tests/lab/node_modules by .ci/setup.d/browser.sh): its ajv validators, generated
// from the Prometheus Operator's Go API types, check types, required fields, patterns and enums,
// but accept fields they do not know.  Unknown fields are refused here by walking the object
// against the package's TypeScript declarations (each `export declare class` lists every field of
// its type, inherited ones included).  Map values ({[key: string]: ...}) are not walked further.
//
// Usage: node podmonitor_validate.mjs [NODE_MODULES] < podmonitor.json
// Prints one error a line ("<path>: <message>") and exits 1 when the object is refused, 0 when it
// is accepted, 2 when the package cannot be loaded.
import { existsSync, readFileSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const modules = resolve(process.argv[2] ?? join(here, "..", "lab", "node_modules"));
const pkg = join(modules, "@kubernetes-models", "prometheus-operator");
const entry = join(pkg, "monitoring.coreos.com", "v1", "PodMonitor");

function fail(message) {
  process.stderr.write(`podmonitor_validate: ${message}\n`);
  process.exit(2);
}

// One .d.ts file: its class's fields, each {name, type, map}, and the modules its types come from.
const declarations = new Map();
function declaration(file) {
  if (declarations.has(file)) return declarations.get(file);
  if (!existsSync(file)) fail(`no type declarations at ${file}`);
  const lines = readFileSync(file, "utf8").split("\n");
  const imports = new Map();
  for (const line of lines) {
    const m = /^import \{ (.+) \} from "(.+)";$/.exec(line);
    if (m) for (const name of m[1].split(", ")) imports.set(name, m[2]);
  }
  let fields = null; // null: a type alias (a string, a number, an enum): nothing to walk
  const start = lines.findIndex((l) => l.startsWith("export declare class "));
  if (start >= 0) {
    fields = new Map();
    for (let i = start + 1; i < lines.length && lines[i] !== "}"; i++) {
      const m = /^ {4}"([^"]+)"\??: (.*?);?$/.exec(lines[i]);
      if (m) fields.set(m[1], { type: m[2], map: m[2] === "{" });
    }
  }
  const found = { file, imports, fields };
  declarations.set(file, found);
  return found;
}

// The .d.ts file that declares `name`, as imported by `from`.
function typeFile(from, name) {
  const spec = from.imports.get(name);
  if (spec === undefined) return null; // a built-in type (string, number, a literal union)
  const base = spec.startsWith(".") ? resolve(dirname(from.file), spec) : join(modules, spec);
  return `${base.replace(/\.js$/, "")}.d.ts`;
}

function unknownFields(value, decl, path, out) {
  if (decl.fields === null || value === null || typeof value !== "object") return;
  for (const [key, item] of Object.entries(value)) {
    const field = decl.fields.get(key);
    const at = `${path}/${key}`;
    if (field === undefined) {
      out.push(`${at}: unknown field "${key}" (not in ${decl.file.slice(modules.length + 1)})`);
      continue;
    }
    if (field.map) continue;
    const array = /^Array<(\w+)>$/.exec(field.type);
    const name = array ? array[1] : field.type;
    const file = /^\w+$/.test(name) ? typeFile(decl, name) : null;
    if (file === null) continue;
    const inner = declaration(file);
    if (array && Array.isArray(item)) item.forEach((x, i) => unknownFields(x, inner, `${at}/${i}`, out));
    else unknownFields(item, inner, at, out);
  }
}

let PodMonitor;
try {
  ({ PodMonitor } = await import(pathToFileURL(`${entry}.js`).href));
} catch (e) {
  fail(`cannot load @kubernetes-models/prometheus-operator from ${modules}: ${e.message}`);
}
const data = JSON.parse(readFileSync(0, "utf8"));
const errors = [];
try {
  new PodMonitor(data).validate();
} catch (e) {
  if (!Array.isArray(e.errors)) throw e;
  for (const err of e.errors) errors.push(`${err.instancePath || "/"}: ${err.message}`);
}
unknownFields(data, declaration(`${entry}.d.ts`), "", errors);
for (const line of errors) process.stdout.write(`${line}\n`);
process.exit(errors.length ? 1 : 0);
