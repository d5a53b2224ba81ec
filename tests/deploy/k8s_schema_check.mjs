// Validates the Kubernetes manifests in deploy/k8s against the Kubernetes OpenAPI schemas, as
// the npm package kubernetes-models compiles them (JSON Schema, checked by ajv): types, required
// fields, enums, quantity and int-or-string formats. Not an API server: defaults, admission and
// cross-object rules are not applied (check_deploy_files.py covers the cross-object rules).
//
// Needs Node.js and a folder holding kubernetes-models and js-yaml, which this script does not
// install:
//   mkdir -p /tmp/k8s-models && npm install --prefix /tmp/k8s-models kubernetes-models@5.1.0 js-yaml@4
//   node tests/deploy/k8s_schema_check.mjs /tmp/k8s-models/node_modules deploy/k8s
// ctest runs it when CMake is given -DATTN_K8S_MODELS_DIR=/tmp/k8s-models/node_modules.
// Exit status: 0 all valid, 1 a document is invalid or of a kind with no model here, 2 usage.
import fs from "node:fs";
import path from "node:path";

const [modules, dir] = process.argv.slice(2);
if (!modules || !dir) {
  console.error("usage: k8s_schema_check.mjs NODE_MODULES_DIR MANIFEST_DIR");
  process.exit(2);
}
const load = async (rel) => import(path.resolve(modules, rel));
const yaml = (await load("js-yaml/index.js")).default;
const models = {
  "apps/v1/Deployment": (await load("kubernetes-models/apps/v1/Deployment.js")).Deployment,
  "apps/v1/StatefulSet": (await load("kubernetes-models/apps/v1/StatefulSet.js")).StatefulSet,
  "v1/Service": (await load("kubernetes-models/v1/Service.js")).Service,
  "v1/ConfigMap": (await load("kubernetes-models/v1/ConfigMap.js")).ConfigMap,
  "policy/v1/PodDisruptionBudget": (await load("kubernetes-models/policy/v1/PodDisruptionBudget.js"))
    .PodDisruptionBudget,
  "autoscaling/v2/HorizontalPodAutoscaler": (
    await load("kubernetes-models/autoscaling/v2/HorizontalPodAutoscaler.js")
  ).HorizontalPodAutoscaler,
};
// Kustomize's own file is not a Kubernetes API object.
const notApiObjects = new Set(["kustomize.config.k8s.io/v1beta1/Kustomization"]);

let failed = 0;
let validated = 0;
for (const file of fs.readdirSync(dir).filter((f) => /\.ya?ml$/.test(f)).sort()) {
  yaml.loadAll(fs.readFileSync(path.join(dir, file), "utf8"), (doc) => {
    if (!doc) return;
    const key = `${doc.apiVersion}/${doc.kind}`;
    if (notApiObjects.has(key)) return;
    const Model = models[key];
    const name = `${file}: ${key} ${doc.metadata?.name ?? "(no name)"}`;
    if (!Model) {
      failed++;
      console.log(`${name}: no model for this kind here; add it to k8s_schema_check.mjs`);
      return;
    }
    validated++;
    try {
      new Model(doc).validate();
      console.log(`${name}: valid`);
    } catch (e) {
      failed++;
      console.log(`${name}: INVALID: ${e.message}`);
    }
  });
}
console.log(`${validated} documents checked against the Kubernetes schemas, ${failed} failed`);
process.exit(failed ? 1 : 0);
