//! `distro report` against a small in-memory registry on loopback: an attached test summary
//! whose descriptor declares more than the 4 MiB a summary may have (one of 400 MB attached by
//! an older `attach-test`) is left out of its date with a note, the rest of the site is written.
use distro::oci::digest::Digest;
use distro::registry::auth::Credentials;
use distro::registry::client::Client;
use distro::registry::reference::Reference;
use distro::report::{collect, write_site};
use serde_json::{Value, json};
use std::collections::BTreeMap;

const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const SUMMARY: &str = "application/vnd.llm-distro.test-summary.v1+json";

mod http;

/// Serves `routes` (path -> content type, body), 404 for anything else.
fn serve(routes: BTreeMap<String, (String, Vec<u8>)>) -> u16 {
    http::serve(move |r| {
        let path = r.path.split('?').next().unwrap_or("");
        match routes.get(path) {
            Some((t, b)) => http::resp(200, &[("Content-Type", t)], b),
            None => http::resp(404, &[("Content-Type", "text/plain")], b"not found"),
        }
    })
    .0
}

fn desc(media_type: &str, bytes: &[u8]) -> Value {
    json!({"mediaType": media_type, "digest": Digest::of(bytes).to_string(), "size": bytes.len()})
}

fn summary(started: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "format": "engine-test-all-summary", "mode": "quick", "device_class": "cpu", "device": "cpu <2 threads>",
        "started": started, "passed": 1, "failed": 0, "skipped": 0,
        "checks": [{"name": "a", "status": "pass"}]
    }))
    .unwrap()
}

#[test]
fn a_test_summary_over_the_limit_is_left_out_with_a_note_and_the_site_is_written() {
    let mut routes = BTreeMap::new();
    let mut put = |path: String, ctype: &str, bytes: &[u8]| {
        routes.insert(path, (ctype.to_string(), bytes.to_vec()));
    };
    let config = br#"{"architecture":"amd64","os":"linux","config":{},"history":[{"created_by":"base"}]}"#.to_vec();
    let layer = b"not a gzip layer".to_vec();
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": desc("application/vnd.oci.image.config.v1+json", &config),
        "layers": [desc("application/vnd.oci.image.layer.v1.tar+gzip", &layer)]
    }))
    .unwrap();
    let mut m = desc(OCI_MANIFEST, &manifest);
    m["platform"] = json!({"os": "linux", "architecture": "amd64"});
    let index = serde_json::to_vec(&json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [m]})).unwrap();
    let index_digest = Digest::of(&index).to_string();
    // Two summaries attached: a good one, and one whose descriptor declares 400 MB (its blob is
    // never asked for: the route does not exist, and a fetch would fail the test).
    let good = summary("2026-01-01T03:00:00Z");
    let mut huge = desc(SUMMARY, b"x");
    huge["size"] = json!(400_000_000u64);
    let artifact = |layer: Value| {
        let mut layer = layer;
        layer["annotations"] = json!({"io.github.llm-distro.platform": "linux/amd64"});
        serde_json::to_vec(&json!({
            "schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": SUMMARY,
            "config": desc("application/vnd.oci.empty.v1+json", b"{}"),
            "layers": [layer],
            "subject": desc(OCI_INDEX, &index)
        }))
        .unwrap()
    };
    let (a_good, a_huge) = (artifact(desc(SUMMARY, &good)), artifact(huge));
    let referrers = serde_json::to_vec(&json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [
        {"mediaType": OCI_MANIFEST, "artifactType": SUMMARY, "digest": Digest::of(&a_good).to_string(), "size": a_good.len()},
        {"mediaType": OCI_MANIFEST, "artifactType": SUMMARY, "digest": Digest::of(&a_huge).to_string(), "size": a_huge.len()},
    ]}))
    .unwrap();
    let r = "/v2/distro";
    put(format!("{r}/tags/list"), "application/json", br#"{"name":"distro","tags":["engine-2026-01-01"]}"#);
    put(format!("{r}/manifests/engine-2026-01-01"), OCI_INDEX, &index);
    put(format!("{r}/manifests/{index_digest}"), OCI_INDEX, &index);
    put(format!("{r}/manifests/{}", Digest::of(&manifest)), OCI_MANIFEST, &manifest);
    put(format!("{r}/manifests/{}", Digest::of(&a_good)), OCI_MANIFEST, &a_good);
    put(format!("{r}/manifests/{}", Digest::of(&a_huge)), OCI_MANIFEST, &a_huge);
    put(format!("{r}/blobs/{}", Digest::of(&config)), "application/octet-stream", &config);
    put(format!("{r}/blobs/{}", Digest::of(&layer)), "application/octet-stream", &layer);
    put(format!("{r}/blobs/{}", Digest::of(&good)), "application/octet-stream", &good);
    put(format!("{r}/referrers/{index_digest}"), OCI_INDEX, &referrers);
    put("/v2/".into(), "application/json", b"{}");
    let port = serve(routes);

    let client = Client::new(Credentials::new(None, None), vec![]).unwrap();
    let repo = Reference::parse(&format!("127.0.0.1:{port}/distro")).unwrap();
    let (nights, before) = collect(&client, &repo, "engine", None).unwrap();
    assert!(before.is_none());
    assert_eq!(nights.len(), 1);
    let n = &nights[0];
    assert_eq!(n.tests.len(), 1, "the good summary is kept: {:?}", n.notes);
    assert_eq!(n.tests[0].summary.passed, 1);
    assert_eq!(n.notes.len(), 1, "{:?}", n.notes);
    let note = &n.notes[0];
    assert!(
        note.starts_with(&format!("linux/amd64 test summary (referrer {}) left out: ", Digest::of(&a_huge))),
        "{note}"
    );
    assert!(note.ends_with(&format!("left out: test summary {}: its descriptor declares 400000000 bytes, more than the 4194304 bytes (4 MiB) a test summary may have; refusing it unread", Digest::of(b"x"))), "{note}");

    let out = tempfile::tempdir().unwrap();
    let written = write_site(out.path(), &repo, &nights, None).unwrap();
    assert_eq!(written, vec!["index.html".to_string()]);
    let page = std::fs::read_to_string(out.path().join("index.html")).unwrap();
    assert!(page.contains("<div class=\"note\">note: linux/amd64 test summary (referrer "), "the page shows the note");
    assert!(page.contains("1 passed, 0 failed, 0 skipped"));
}
