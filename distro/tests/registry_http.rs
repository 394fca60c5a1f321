//! The registry client against small HTTP servers on loopback: what it sends where (credentials
//! never follow a redirect to another origin), the Bearer token flow, retries, and refusing
//! content that does not match its digest.
use distro::oci::digest::Digest;
use distro::oci::store::BlobStore;
use distro::registry::auth::{Credential, Credentials};
use distro::registry::client::Client;
use distro::registry::reference::Reference;
use distro::retry::Policy;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod http;

use http::{Log, resp, serve};

fn client(host: &str, cred: Option<Credential>) -> Client {
    let mut c = Client::new(Credentials::new(cred.map(|c| (host.to_string(), c)), None), vec![]).unwrap();
    c.retry = Policy { attempts: 4, first_backoff: Duration::from_millis(10), max_delay: Duration::from_millis(50) };
    c
}

fn basic() -> Credential {
    Credential::Basic { user: "user".into(), password: "secret".into() }
}

#[test]
fn credentials_do_not_follow_a_redirect_to_another_origin() {
    let body = b"layer bytes".to_vec();
    let digest = Digest::of(&body);
    let blob = body.clone();
    let (storage, storage_log) = serve(move |_| resp(200, &[], &blob));
    let (registry, registry_log) = serve(move |r| {
        if !r.headers.contains_key("authorization") {
            return resp(401, &[("WWW-Authenticate", r#"Basic realm="test""#)], b"");
        }
        let loc = format!("http://127.0.0.1:{storage}/blobs/x?signature=s3cr3t");
        resp(307, &[("Location", &loc)], b"")
    });
    let host = format!("127.0.0.1:{registry}");
    let c = client(&host, Some(basic()));
    let dir = tempfile::tempdir().unwrap();
    let store = BlobStore::new(dir.path());
    let r = Reference::parse(&format!("{host}/repo:tag")).unwrap();
    c.fetch_blob(&r, &digest, Some(body.len() as u64), &store).unwrap();
    assert_eq!(store.read(&digest).unwrap(), body);
    let reg = registry_log.lock().unwrap();
    assert!(reg.iter().any(|q| q.headers.get("authorization").is_some_and(|a| a.starts_with("Basic "))));
    let sto = storage_log.lock().unwrap();
    assert_eq!(sto.len(), 1);
    assert_eq!(sto[0].method, "GET");
    assert!(
        !sto[0].headers.contains_key("authorization"),
        "credentials leaked to another origin: {:?}",
        sto[0].headers
    );
}

#[test]
fn bearer_flow_with_scope_and_basic_credentials_at_the_realm() {
    let manifest =
        br#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{},"layers":[]}"#
            .to_vec();
    let digest = Digest::of(&manifest);
    let port = Arc::new(Mutex::new(0u16));
    let p2 = port.clone();
    let m = manifest.clone();
    let (registry, log) = serve(move |r| {
        let me = *p2.lock().unwrap();
        if r.path.starts_with("/token") {
            // user:secret
            if r.headers.get("authorization").map(String::as_str) != Some("Basic dXNlcjpzZWNyZXQ=") {
                return resp(401, &[], b"");
            }
            return resp(200, &[("Content-Type", "application/json")], br#"{"access_token":"tok-1"}"#);
        }
        if r.headers.get("authorization").map(String::as_str) != Some("Bearer tok-1") {
            let ch =
                format!(r#"Bearer realm="http://127.0.0.1:{me}/token",service="svc",scope="repository:team/app:pull""#);
            return resp(401, &[("WWW-Authenticate", &ch)], b"");
        }
        resp(200, &[("Content-Type", "application/vnd.oci.image.manifest.v1+json")], &m)
    });
    *port.lock().unwrap() = registry;
    let host = format!("127.0.0.1:{registry}");
    let c = client(&host, Some(basic()));
    let f = c.fetch_manifest(&Reference::parse(&format!("{host}/team/app:v1")).unwrap()).unwrap();
    assert_eq!(f.digest, digest);
    assert_eq!(f.media_type, "application/vnd.oci.image.manifest.v1+json");
    let log = log.lock().unwrap();
    let token_req = log.iter().find(|r| r.path.starts_with("/token")).expect("token requested");
    assert!(token_req.path.contains("service=svc"), "{}", token_req.path);
    assert!(token_req.path.contains("scope=repository%3Ateam%2Fapp%3Apull"), "{}", token_req.path);
    // A second request reuses the token: no new token request.
    drop(log);
    c.fetch_manifest(&Reference::parse(&format!("{host}/team/app:v1")).unwrap()).unwrap();
}

#[test]
fn no_credentials_is_a_clear_error() {
    let (registry, _) = serve(|_| resp(401, &[("WWW-Authenticate", r#"Basic realm="x""#)], b""));
    let host = format!("127.0.0.1:{registry}");
    let c = client(&host, None);
    let e = c.fetch_manifest(&Reference::parse(&format!("{host}/a:b")).unwrap()).unwrap_err();
    let msg = format!("{e:#}");
    assert!(msg.contains("no credentials found") && msg.contains("docker login"), "{msg}");
}

#[test]
fn rejected_credentials_name_their_origin_not_their_value() {
    let (registry, _) = serve(|_| resp(401, &[("WWW-Authenticate", r#"Basic realm="x""#)], b""));
    let host = format!("127.0.0.1:{registry}");
    let c = client(&host, Some(basic()));
    let msg = format!("{:#}", c.fetch_manifest(&Reference::parse(&format!("{host}/a:b")).unwrap()).unwrap_err());
    assert!(msg.contains("rejected the credentials from DISTRO_REGISTRY_USER"), "{msg}");
    assert!(!msg.contains("secret"), "{msg}");
}

#[test]
fn transient_failures_are_retried() {
    let count = Arc::new(Mutex::new(0));
    let c2 = count.clone();
    let manifest = br#"{"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[]}"#.to_vec();
    let m = manifest.clone();
    let (registry, _) = serve(move |_| {
        let mut n = c2.lock().unwrap();
        *n += 1;
        if *n <= 2 { resp(503, &[("Retry-After", "0")], b"busy") } else { resp(200, &[], &m) }
    });
    let host = format!("127.0.0.1:{registry}");
    let f = client(&host, None).fetch_manifest(&Reference::parse(&format!("{host}/a:b")).unwrap()).unwrap();
    assert_eq!(f.digest, Digest::of(&manifest));
    assert_eq!(*count.lock().unwrap(), 3);
}

#[test]
fn content_that_does_not_match_its_digest_is_refused() {
    let good = br#"{"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[]}"#.to_vec();
    let wanted = Digest::of(&good);
    let (registry, _) = serve(|r| {
        if r.path.contains("/blobs/") {
            resp(200, &[], b"tampered layer")
        } else {
            resp(200, &[], br#"{"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{}]}"#)
        }
    });
    let host = format!("127.0.0.1:{registry}");
    let c = client(&host, None);
    let e = c.fetch_manifest(&Reference::parse(&format!("{host}/a@{wanted}")).unwrap()).unwrap_err();
    assert!(format!("{e:#}").contains("refusing it"), "{e:#}");
    let dir = tempfile::tempdir().unwrap();
    let store = BlobStore::new(dir.path());
    let layer = Digest::of(b"original layer");
    let e = c.fetch_blob(&Reference::parse(&format!("{host}/a:b")).unwrap(), &layer, None, &store).unwrap_err();
    assert!(format!("{e:#}").contains("does not match its digest"), "{e:#}");
    assert!(!store.has(&layer));
    // A tag's manifest whose Docker-Content-Digest header disagrees with its bytes is refused too.
    let (registry, _) = serve(|_| {
        resp(
            200,
            &[("Docker-Content-Digest", "sha256:0000000000000000000000000000000000000000000000000000000000000000")],
            br#"{"mediaType":"x"}"#,
        )
    });
    let host = format!("127.0.0.1:{registry}");
    let e = client(&host, None).fetch_manifest(&Reference::parse(&format!("{host}/a:b")).unwrap()).unwrap_err();
    assert!(format!("{e:#}").contains("does not match"), "{e:#}");
    // A manifest larger than 4 MiB is refused once 4 MiB and a byte came.
    let (registry, _) = serve(|_| resp(200, &[], &vec![b' '; (4 << 20) + 1]));
    let host = format!("127.0.0.1:{registry}");
    let e = client(&host, None).fetch_manifest(&Reference::parse(&format!("{host}/a:b")).unwrap()).unwrap_err();
    assert!(format!("{e:#}").contains("a manifest of more than 4194304 bytes (4 MiB); refusing it"), "{e:#}");
}

/// A registry in memory for the referrers tests: blobs and manifests (by digest and by tag),
/// uploads in one PUT, and, when `api`, the referrers API (`GET /v2/r/referrers/DIGEST`).
fn memory_registry(api: bool) -> (u16, Log) {
    use distro::oci::manifest::OCI_INDEX;
    let blobs: Arc<Mutex<BTreeMap<String, Vec<u8>>>> = Arc::default();
    let manifests: Arc<Mutex<BTreeMap<String, Vec<u8>>>> = Arc::default();
    serve(move |r| {
        let path = r.path.split('?').next().unwrap_or("");
        let digest_of = |b: &[u8]| Digest::of(b).to_string();
        match (r.method.as_str(), path.strip_prefix("/v2/r/")) {
            ("HEAD", Some(p)) if p.starts_with("blobs/") => {
                let found = blobs.lock().unwrap().contains_key(&p[6..]);
                resp(if found { 200 } else { 404 }, &[], b"")
            }
            ("GET", Some(p)) if p.starts_with("blobs/") => match blobs.lock().unwrap().get(&p[6..]) {
                Some(b) => resp(200, &[], b),
                None => resp(404, &[], b""),
            },
            ("POST", Some("blobs/uploads/")) => resp(202, &[("Location", "/v2/r/blobs/uploads/1")], b""),
            ("PUT", Some("blobs/uploads/1")) => {
                blobs.lock().unwrap().insert(digest_of(&r.body), r.body.clone());
                resp(201, &[], b"")
            }
            (m @ ("HEAD" | "GET"), Some(p)) if p.starts_with("manifests/") => {
                match manifests.lock().unwrap().get(&p[10..]) {
                    Some(b) => {
                        let d = digest_of(b);
                        let ct = serde_json::from_slice::<serde_json::Value>(b).unwrap()["mediaType"]
                            .as_str()
                            .unwrap()
                            .to_string();
                        let body: &[u8] = if m == "GET" { b } else { b"" };
                        resp(200, &[("Docker-Content-Digest", &d), ("Content-Type", &ct)], body)
                    }
                    None => resp(404, &[], b""),
                }
            }
            ("PUT", Some(p)) if p.starts_with("manifests/") => {
                let d = digest_of(&r.body);
                let mut m = manifests.lock().unwrap();
                m.insert(p[10..].to_string(), r.body.clone());
                m.insert(d.clone(), r.body.clone());
                resp(201, &[("Docker-Content-Digest", &d)], b"")
            }
            ("GET", Some(p)) if api && p.starts_with("referrers/") => {
                let subject = &p[10..];
                let list: Vec<serde_json::Value> = manifests
                    .lock()
                    .unwrap()
                    .iter()
                    .filter(|(k, _)| k.starts_with("sha256:"))
                    .filter_map(|(k, b)| {
                        let v: serde_json::Value = serde_json::from_slice(b).ok()?;
                        (v["subject"]["digest"] == subject).then(|| {
                            serde_json::json!({"mediaType": v["mediaType"], "digest": k, "size": b.len(), "artifactType": v["artifactType"]})
                        })
                    })
                    .collect();
                let body = serde_json::to_vec(
                    &serde_json::json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": list}),
                )
                .unwrap();
                resp(200, &[("Content-Type", OCI_INDEX)], &body)
            }
            _ => resp(404, &[], b""),
        }
    })
}

/// The SBOM and provenance of an index reach a registry through its referrers API where it has
/// one (no fallback tag), through the `sha256-HEX` fallback tag where not; either way they are
/// listed back, and attaching them again adds nothing.
#[test]
fn artifacts_attach_through_the_referrers_api_or_the_fallback_tag() {
    use distro::oci::manifest::{Descriptor, OCI_INDEX};
    use distro::progress::Progress;
    use distro::provenance::{INTOTO_TYPE, SBOM_TYPE, Subject, artifacts, referrers};
    let subject = Subject {
        index: Some(Descriptor::of(OCI_INDEX, b"{\"an\": \"index\"}")),
        annotations: BTreeMap::from([("org.opencontainers.image.revision".to_string(), "a".repeat(40))]),
        platforms: BTreeMap::from([("linux/amd64".to_string(), (Digest::of(b"m"), Some(b"{\"spdx\": 1}".to_vec())))]),
    };
    let index = subject.index.clone().unwrap().digest;
    let arts = artifacts(&subject);
    let tmp = tempfile::tempdir().unwrap();
    let store = BlobStore::new(tmp.path());
    for api in [true, false] {
        let (port, log) = memory_registry(api);
        let host = format!("127.0.0.1:{port}");
        let repo = Reference::parse(&format!("{host}/r")).unwrap();
        let c = client(&host, None);
        let how = referrers::attach(&c, &repo, &index, &arts, &store, &Progress::plain()).unwrap();
        let tag = referrers::fallback_tag(&index);
        let tag_puts = || log.lock().unwrap().iter().filter(|q| q.method == "PUT" && q.path.ends_with(&tag)).count();
        if api {
            assert_eq!(how, "referrers API");
            assert_eq!(tag_puts(), 0, "no fallback tag where the API answers");
        } else {
            assert_eq!(how, format!("tag {tag}"));
            assert_eq!(tag_puts(), 1);
        }
        let (list, found) = referrers::list(&c, &repo, &index).unwrap();
        assert_eq!(found, how);
        let mut kinds: Vec<&str> = list.iter().filter_map(|e| e["artifactType"].as_str()).collect();
        kinds.sort();
        assert_eq!(kinds, [SBOM_TYPE, INTOTO_TYPE]);
        // Again: the same artifacts, nothing new listed.
        referrers::attach(&c, &repo, &index, &arts, &store, &Progress::plain()).unwrap();
        assert_eq!(referrers::list(&c, &repo, &index).unwrap().0.len(), 2);
    }
}

/// A signature (`distro sign`'s manifest) is found back through cosign's tag `sha256-HEX.sig`,
/// and through the referrers (API or fallback tag) when the tag no longer holds it; found once,
/// not twice, when both do.
#[test]
fn a_signature_is_found_through_the_cosign_tag_or_the_referrers() {
    use distro::oci::bundle::ManifestDoc;
    use distro::oci::manifest::{Descriptor, OCI_INDEX, OCI_MANIFEST};
    use distro::progress::Progress;
    use distro::provenance::{referrers, signature};
    use distro::registry::push::{PushOptions, PushPlan, push};
    let index_bytes = b"{\"mediaType\": \"application/vnd.oci.image.index.v1+json\"}".to_vec();
    let index = Descriptor::of(OCI_INDEX, &index_bytes);
    let payload = signature::payload("127.0.0.1/r", &index.digest);
    let art = signature::signature_artifact(&index, &[signature::signature_layer(&payload, "c2ln")], &payload);
    let doc = ManifestDoc::new(OCI_MANIFEST, art.manifest.clone());
    let tmp = tempfile::tempdir().unwrap();
    let store = BlobStore::new(tmp.path());
    for api in [true, false] {
        let (port, _) = memory_registry(api);
        let host = format!("127.0.0.1:{port}");
        let repo = Reference::parse(&format!("{host}/r")).unwrap();
        let c = client(&host, None);
        let none = signature::fetch(&c, &repo, &index.digest, &[], &store).unwrap();
        assert!(none.is_empty());
        referrers::attach(&c, &repo, &index.digest, std::slice::from_ref(&art), &store, &Progress::plain()).unwrap();
        let tag = signature::cosign_tag(&index.digest);
        let plan = PushPlan { tags: [(tag.clone(), doc.clone())].into(), ..PushPlan::default() };
        push(&c, &repo, &plan, &PushOptions::default(), &Progress::plain()).unwrap();
        let (entries, _) = referrers::list(&c, &repo, &index.digest).unwrap();
        let found = signature::fetch(&c, &repo, &index.digest, &entries, &store).unwrap();
        assert_eq!(found.len(), 1, "api {api}: the tag and the referrer are one manifest");
        assert_eq!(found[0].source, format!("tag {tag}"));
        assert_eq!((found[0].payload.clone(), found[0].signature.as_str()), (payload.clone(), "c2ln"));
        assert_eq!(signature::signed_digest(&found[0].payload).as_deref(), Some(index.digest.as_str()));
        // The tag moved onto a manifest without signatures: the referrer still has it.
        let other = ManifestDoc::new(OCI_INDEX, index_bytes.clone());
        let plan =
            PushPlan { manifests: vec![other.clone()], tags: [(tag.clone(), other)].into(), ..PushPlan::default() };
        push(&c, &repo, &plan, &PushOptions::default(), &Progress::plain()).unwrap();
        let found = signature::fetch(&c, &repo, &index.digest, &entries, &store).unwrap();
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].source, format!("referrer {}", doc.digest));
    }
}
