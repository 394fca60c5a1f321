//! Signatures of a pushed index that `cosign verify --key` accepts: cosign's "simple signing"
//! payload, signed with an ECDSA P-256 key (SHA-256, ASN.1 DER, base64), in a manifest tagged
//! `sha256-HEX.sig` beside the index (cosign's tag scheme), whose one layer is the payload with
//! the signature as its annotation.
//!
//! The same manifest also names the index as its `subject` and carries an `artifactType`, and is
//! attached through [`super::referrers`] like the SBOM, so a registry with the referrers API lists
//! it, and `distro verify` finds it either way. cosign reads neither field.
//!
//! Keys: the private key is PKCS#8 PEM, unencrypted (what `openssl genpkey -algorithm EC -pkeyopt
//! ec_paramgen_curve:P-256` writes); the public key is SPKI PEM (`openssl pkey -pubout`, or
//! cosign's `cosign.pub`). Crypto is `ring`'s.
use super::Artifact;
use crate::error::bad_input;
use crate::oci::digest::Digest;
use crate::oci::json::canonical;
use crate::oci::manifest::{Descriptor, OCI_CONFIG, OCI_MANIFEST};
use crate::oci::store::{BlobStore, check_document_size};
use crate::registry::auth::Scope;
use crate::registry::client::Client;
use crate::registry::reference::Reference;
use anyhow::Result;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use ring::rand::SystemRandom;
use ring::signature::{
    ECDSA_P256_SHA256_ASN1, ECDSA_P256_SHA256_ASN1_SIGNING, EcdsaKeyPair, KeyPair, UnparsedPublicKey,
};
use serde_json::{Value, json};
use std::path::Path;

/// The media type of the payload layer (cosign's `SimpleSigningMediaType`).
pub const SIMPLE_SIGNING_TYPE: &str = "application/vnd.dev.cosign.simplesigning.v1+json";
/// The layer annotation holding the base64 signature.
pub const SIGNATURE_ANNOTATION: &str = "dev.cosignproject.cosign/signature";
/// The `artifactType` of the signature manifest as a referrer (cosign's, for signatures).
pub const SIGNATURE_TYPE: &str = "application/vnd.dev.cosign.artifact.sig.v1+json";
/// The payload's `critical.type`.
pub const COSIGN_SIGNATURE: &str = "cosign container image signature";

/// The tag cosign reads the signatures of `subject` from: `sha256-HEX.sig`.
pub fn cosign_tag(subject: &Digest) -> String {
    format!("{}.sig", super::referrers::fallback_tag(subject))
}

/// The payload's `docker-reference`: the repository as go-containerregistry names it
/// (`ref.Context().Name()`), Docker Hub's as `index.docker.io/...`.
pub fn identity(repo: &Reference) -> String {
    let registry = if repo.registry == "docker.io" { "index.docker.io" } else { &repo.registry };
    format!("{registry}/{}", repo.repository)
}

/// cosign's simple signing payload for `digest` in repository `identity`, byte for byte as cosign
/// marshals it (Go's `encoding/json`: fields in declaration order, no whitespace, no newline,
/// `<`, `>`, `&`, U+2028 and U+2029 escaped).
pub fn payload(identity: &str, digest: &Digest) -> Vec<u8> {
    format!(
        r#"{{"critical":{{"identity":{{"docker-reference":{}}},"image":{{"docker-manifest-digest":{}}},"type":{}}},"optional":null}}"#,
        go_string(identity),
        go_string(digest.as_str()),
        go_string(COSIGN_SIGNATURE)
    )
    .into_bytes()
}

fn go_string(s: &str) -> String {
    let quoted = serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into());
    quoted
        .replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026")
        .replace('\u{2028}', "\\u2028")
        .replace('\u{2029}', "\\u2029")
}

/// The digest a payload signs (`critical.image.docker-manifest-digest`), when it is a cosign
/// container image signature.
pub fn signed_digest(payload: &[u8]) -> Option<String> {
    let v: Value = serde_json::from_slice(payload).ok()?;
    if v["critical"]["type"] != COSIGN_SIGNATURE {
        return None;
    }
    v["critical"]["image"]["docker-manifest-digest"].as_str().map(String::from)
}

/// One PEM block: its label and DER bytes. `what` names the file in messages.
fn pem(text: &str, what: &str) -> Result<(String, Vec<u8>)> {
    let Some(start) = text.find("-----BEGIN ") else {
        return Err(bad_input(format!("{what}: not a PEM file (no -----BEGIN line)")));
    };
    let rest = &text[start + 11..];
    let Some(end_label) = rest.find("-----") else {
        return Err(bad_input(format!("{what}: not a PEM file (a -----BEGIN line without its closing dashes)")));
    };
    let label = rest[..end_label].to_string();
    let body = &rest[end_label + 5..];
    let end_marker = format!("-----END {label}-----");
    let Some(end) = body.find(&end_marker) else {
        return Err(bad_input(format!("{what}: not a PEM file (no {end_marker} line)")));
    };
    let b64: String = body[..end].lines().filter(|l| !l.contains(':')).flat_map(|l| l.trim().chars()).collect();
    let der =
        STANDARD.decode(b64).map_err(|e| bad_input(format!("{what}: the {label} PEM block is not base64: {e}")))?;
    Ok((label, der))
}

/// What kind of key `der` holds, by the algorithm and curve OIDs it contains, for messages.
fn key_kind(der: &[u8]) -> &'static str {
    let has = |oid: &[u8]| der.windows(oid.len()).any(|w| w == oid);
    if has(&[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x01]) {
        "an RSA key"
    } else if has(&[0x2b, 0x65, 0x70]) {
        "an Ed25519 key"
    } else if has(&[0x2b, 0x81, 0x04, 0x00, 0x22]) {
        "an ECDSA P-384 key"
    } else if has(&[0x2b, 0x81, 0x04, 0x00, 0x23]) {
        "an ECDSA P-521 key"
    } else if has(&[0x2b, 0x81, 0x04, 0x00, 0x0a]) {
        "an ECDSA secp256k1 key"
    } else if has(&[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07]) {
        "an ECDSA P-256 key ring cannot read (PKCS#8 v1 with the public key inside is needed)"
    } else if has(&[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01]) {
        "an EC key on another curve"
    } else {
        "not a key distro knows"
    }
}

fn read_key_file(path: &Path, what: &str) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| bad_input(format!("{what} {}: {e}", path.display())))
}

/// An ECDSA P-256 private key.
pub struct SigningKey {
    pair: EcdsaKeyPair,
    rng: SystemRandom,
}

impl SigningKey {
    /// Reads a PKCS#8 PEM private key file.
    pub fn load(path: &Path) -> Result<SigningKey> {
        let what = format!("--key {}", path.display());
        SigningKey::from_pem(&read_key_file(path, "--key")?, &what)
    }

    /// Parses a PKCS#8 PEM private key (`-----BEGIN PRIVATE KEY-----`, unencrypted, P-256).
    pub fn from_pem(text: &str, what: &str) -> Result<SigningKey> {
        let (label, der) = pem(text, what)?;
        let openssl = "openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out key.pem";
        match label.as_str() {
            "PRIVATE KEY" => {}
            "EC PRIVATE KEY" => {
                return Err(bad_input(format!(
                    "{what}: a SEC1 EC key (BEGIN EC PRIVATE KEY); distro reads PKCS#8: convert it with `openssl pkcs8 -topk8 -nocrypt -in KEY -out key.pem`"
                )));
            }
            l if l.contains("ENCRYPTED") => {
                return Err(bad_input(format!(
                    "{what}: an encrypted key (BEGIN {l}); distro signs with an unencrypted PKCS#8 P-256 key: generate one with `{openssl}` (and `cosign import-key-pair --key key.pem` to use it with cosign too)"
                )));
            }
            "PUBLIC KEY" => {
                return Err(bad_input(format!(
                    "{what}: a public key; distro sign needs the private key (BEGIN PRIVATE KEY)"
                )));
            }
            l => return Err(bad_input(format!("{what}: a PEM block of {l}, not BEGIN PRIVATE KEY"))),
        }
        let rng = SystemRandom::new();
        let pair = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, &der, &rng).map_err(|_| {
            bad_input(format!(
                "{what}: {}; distro signs with ECDSA P-256 (cosign's default): generate a key with `{openssl}`",
                key_kind(&der)
            ))
        })?;
        Ok(SigningKey { pair, rng })
    }

    /// The ASN.1 DER ECDSA P-256 SHA-256 signature of `message`.
    pub fn sign(&self, message: &[u8]) -> Result<Vec<u8>> {
        let sig = self.pair.sign(&self.rng, message).map_err(|_| anyhow::anyhow!("ECDSA signing failed"))?;
        Ok(sig.as_ref().to_vec())
    }

    /// The public half.
    pub fn public_key(&self) -> PublicKey {
        PublicKey { point: self.pair.public_key().as_ref().to_vec() }
    }
}

/// The DER prefix of every P-256 SubjectPublicKeyInfo: SEQUENCE { SEQUENCE { id-ecPublicKey,
/// prime256v1 }, BIT STRING (65 bytes, no unused bits) }; the uncompressed point follows.
const P256_SPKI_PREFIX: [u8; 26] = [
    0x30, 0x59, 0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, 0x06, 0x08, 0x2a, 0x86, 0x48, 0xce,
    0x3d, 0x03, 0x01, 0x07, 0x03, 0x42, 0x00,
];

/// An ECDSA P-256 public key (its uncompressed point).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublicKey {
    point: Vec<u8>,
}

impl PublicKey {
    /// Reads an SPKI PEM public key file (`-----BEGIN PUBLIC KEY-----`, e.g. cosign.pub).
    pub fn load(path: &Path) -> Result<PublicKey> {
        let what = format!("--key {}", path.display());
        PublicKey::from_pem(&read_key_file(path, "--key")?, &what)
    }

    /// Parses an SPKI PEM public key; only P-256 is accepted.
    pub fn from_pem(text: &str, what: &str) -> Result<PublicKey> {
        let (label, der) = pem(text, what)?;
        if label != "PUBLIC KEY" {
            let hint = if label.contains("PRIVATE KEY") {
                ": give the public key (openssl pkey -in key.pem -pubout)"
            } else {
                ""
            };
            return Err(bad_input(format!("{what}: a PEM block of {label}, not BEGIN PUBLIC KEY{hint}")));
        }
        if der.len() != P256_SPKI_PREFIX.len() + 65 || der[..P256_SPKI_PREFIX.len()] != P256_SPKI_PREFIX {
            return Err(bad_input(format!(
                "{what}: {}; distro verifies ECDSA P-256 signatures (cosign's default), so the key must be P-256",
                key_kind(&der)
            )));
        }
        let point = der[P256_SPKI_PREFIX.len()..].to_vec();
        if point[0] != 0x04 {
            return Err(bad_input(format!("{what}: the P-256 public key is not an uncompressed point")));
        }
        Ok(PublicKey { point })
    }

    /// The SPKI PEM text of the key.
    pub fn to_pem(&self) -> String {
        let mut der = P256_SPKI_PREFIX.to_vec();
        der.extend_from_slice(&self.point);
        let b64 = STANDARD.encode(der);
        let lines: Vec<&str> = b64.as_bytes().chunks(64).map(|c| std::str::from_utf8(c).unwrap_or("")).collect();
        format!("-----BEGIN PUBLIC KEY-----\n{}\n-----END PUBLIC KEY-----\n", lines.join("\n"))
    }

    /// Whether `signature` (ASN.1 DER) is this key's signature of `message`.
    pub fn verifies(&self, message: &[u8], signature: &[u8]) -> bool {
        UnparsedPublicKey::new(&ECDSA_P256_SHA256_ASN1, &self.point).verify(message, signature).is_ok()
    }
}

/// One signature read back from the registry: the payload, its base64 signature, and where it
/// was found (for messages).
#[derive(Clone, Debug)]
pub struct Found {
    /// The payload blob's bytes.
    pub payload: Vec<u8>,
    /// The layer's `dev.cosignproject.cosign/signature` annotation.
    pub signature: String,
    /// Where it came from: `tag sha256-HEX.sig` or `referrer DIGEST`.
    pub source: String,
}

impl Found {
    /// Whether `key` made this signature (whatever the payload says).
    pub fn made_by(&self, key: &PublicKey) -> bool {
        STANDARD.decode(self.signature.trim()).is_ok_and(|sig| key.verifies(&self.payload, &sig))
    }
}

/// Checks that one of `found` is `key`'s signature over `subject`; returns it. Each failure is
/// bad input, on one line: nothing found, a signature of another key (or tampered with), one of
/// this key over another digest. `image` and `key_name` name them in messages.
pub fn check<'a>(
    found: &'a [Found],
    key: &PublicKey,
    subject: &Digest,
    image: &str,
    key_name: &str,
) -> Result<&'a Found> {
    if found.is_empty() {
        return Err(missing(image, subject));
    }
    let by_key: Vec<&Found> = found.iter().filter(|f| f.made_by(key)).collect();
    if let Some(f) = by_key.iter().find(|f| signed_digest(&f.payload).as_deref() == Some(subject.as_str())) {
        return Ok(f);
    }
    if let Some(f) = by_key.first() {
        let names =
            signed_digest(&f.payload).unwrap_or_else(|| "no digest (not a cosign container image signature)".into());
        return Err(bad_input(format!(
            "{image} ({subject}): the signature in {} is {key_name}'s but over another digest: its payload names {names}",
            f.source
        )));
    }
    let sources: Vec<&str> = found.iter().map(|f| f.source.as_str()).collect();
    Err(bad_input(format!(
        "{image} ({subject}): none of its {} signature(s) ({}) verifies with {key_name}: signed with another key, or tampered with",
        found.len(),
        sources.join(", ")
    )))
}

/// The error for an index with no signature.
pub fn missing(image: &str, subject: &Digest) -> anyhow::Error {
    bad_input(format!(
        "{image} ({subject}) is not signed: no tag {} and no signature referrer; sign it with `distro sign {image} --key KEY.pem`",
        cosign_tag(subject)
    ))
}

/// A layer of a signature manifest: its descriptor as JSON (kept as read, so that layers cosign
/// wrote keep their other annotations).
pub fn signature_layer(payload: &[u8], signature_b64: &str) -> Value {
    json!({
        "mediaType": SIMPLE_SIGNING_TYPE,
        "size": payload.len(),
        "digest": Digest::of(payload),
        "annotations": {SIGNATURE_ANNOTATION: signature_b64},
    })
}

/// The config cosign (go-containerregistry's `mutate.Append` on `empty.Image`) writes for
/// signature layers `diff_ids`: Go's field order, zero times.
pub fn cosign_config(diff_ids: &[String]) -> Vec<u8> {
    let history = vec![r#"{"created":"0001-01-01T00:00:00Z"}"#; diff_ids.len()].join(",");
    let ids: Vec<String> = diff_ids.iter().map(|d| go_string(d)).collect();
    format!(
        r#"{{"architecture":"","created":"0001-01-01T00:00:00Z","history":[{history}],"os":"","rootfs":{{"type":"layers","diff_ids":[{}]}},"config":{{}}}}"#,
        ids.join(",")
    )
    .into_bytes()
}

/// The signature manifest of `subject` with `layers` (earlier signatures first, then the new
/// one, whose payload is `new_payload`), as an artifact: the manifest and the blobs to push (the
/// config and the new payload; earlier payloads are in the repository already).
pub fn signature_artifact(subject: &Descriptor, layers: &[Value], new_payload: &[u8]) -> Artifact {
    let diff_ids: Vec<String> = layers.iter().filter_map(|l| l["digest"].as_str().map(String::from)).collect();
    let config = cosign_config(&diff_ids);
    let subject = Descriptor { platform: None, annotations: None, ..subject.clone() };
    let manifest = canonical(&json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": SIGNATURE_TYPE,
        "config": {"mediaType": OCI_CONFIG, "size": config.len(), "digest": Digest::of(&config)},
        "layers": layers,
        "subject": subject,
    }));
    Artifact { artifact_type: SIGNATURE_TYPE, manifest, blobs: vec![config, new_payload.to_vec()] }
}

/// The signatures in a signature manifest's bytes: each simple-signing layer's descriptor
/// (`mediaType`, `digest`, `size`) and its signature annotation.
pub fn signature_layers(manifest: &[u8]) -> Vec<(Descriptor, String)> {
    let Ok(v) = serde_json::from_slice::<Value>(manifest) else { return Vec::new() };
    v["layers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|l| l["mediaType"] == SIMPLE_SIGNING_TYPE)
        .filter_map(|l| {
            let sig = l["annotations"][SIGNATURE_ANNOTATION].as_str()?.to_owned();
            let d = serde_json::from_value::<Descriptor>(l.clone()).ok()?;
            Some((d, sig))
        })
        .collect()
}

/// The signatures attached to `subject` in `repo`: those in cosign's tag `sha256-HEX.sig`, then
/// those of signature referrers (`referrers`, as [`super::referrers::list`] returned them) that
/// the tag does not already hold. Blobs go through `store`.
pub fn fetch(
    client: &Client,
    repo: &Reference,
    subject: &Digest,
    referrers: &[Value],
    store: &BlobStore,
) -> Result<Vec<Found>> {
    let mut found = Vec::new();
    let tag = cosign_tag(subject);
    let scopes = vec![Scope::repository(&repo.repository, &["pull"])];
    let tagged = client.manifest_digest(&repo.with_tag(&tag), scopes)?;
    if tagged.is_some() {
        let m = client.fetch_manifest(&repo.with_tag(&tag))?;
        found.extend(read_layers(client, repo, &m.bytes, store, &format!("tag {tag}"))?);
    }
    for e in referrers.iter().filter(|e| e["artifactType"] == SIGNATURE_TYPE) {
        let Some(d) = e["digest"].as_str().and_then(|d| Digest::parse(d).ok()) else { continue };
        if tagged.as_ref() == Some(&d) {
            continue;
        }
        let m = client.fetch_manifest(&repo.with_digest(&d))?;
        let v: Value = serde_json::from_slice(&m.bytes).unwrap_or_default();
        if v["subject"]["digest"] != subject.as_str() {
            continue;
        }
        found.extend(read_layers(client, repo, &m.bytes, store, &format!("referrer {d}"))?);
    }
    Ok(found)
}

fn read_layers(
    client: &Client,
    repo: &Reference,
    manifest: &[u8],
    store: &BlobStore,
    source: &str,
) -> Result<Vec<Found>> {
    let mut found = Vec::new();
    for (d, signature) in signature_layers(manifest) {
        check_document_size(&d.digest, d.size)?;
        if !store.has(&d.digest) {
            client.fetch_blob(repo, &d.digest, Some(d.size), store)?;
        }
        found.push(Found { payload: store.read(&d.digest)?, signature, source: source.to_owned() });
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn key() -> SigningKey {
        let rng = SystemRandom::new();
        let doc = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, &rng).unwrap();
        let b64 = STANDARD.encode(doc.as_ref());
        SigningKey::from_pem(&format!("-----BEGIN PRIVATE KEY-----\n{b64}\n-----END PRIVATE KEY-----\n"), "test key")
            .unwrap()
    }

    fn found(k: &SigningKey, payload: &[u8]) -> Found {
        Found {
            payload: payload.to_vec(),
            signature: STANDARD.encode(k.sign(payload).unwrap()),
            source: "tag sha256-x.sig".into(),
        }
    }

    #[test]
    fn the_payload_is_byte_for_byte_cosigns() {
        let d = Digest::parse(&format!("sha256:{}", "ab".repeat(32))).unwrap();
        let expected = format!(
            "{{\"critical\":{{\"identity\":{{\"docker-reference\":\"127.0.0.1:5701/distro\"}},\"image\":{{\"docker-manifest-digest\":\"{d}\"}},\"type\":\"cosign container image signature\"}},\"optional\":null}}"
        );
        let r = Reference::parse("127.0.0.1:5701/distro:engine").unwrap();
        assert_eq!(String::from_utf8(payload(&identity(&r), &d)).unwrap(), expected);
        assert_eq!(identity(&Reference::parse("debian:bookworm").unwrap()), "index.docker.io/library/debian");
        assert_eq!(go_string("a<b>&c"), r#""a\u003cb\u003e\u0026c""#, "Go's HTML-safe escaping");
        assert_eq!(signed_digest(&payload("x/y", &d)).as_deref(), Some(d.as_str()));
        assert_eq!(cosign_tag(&d), format!("sha256-{}.sig", d.hex()));
    }

    #[test]
    fn a_signature_round_trips_and_a_wrong_key_or_digest_is_refused() {
        let k = key();
        let a = Digest::of(b"index a");
        let b = Digest::of(b"index b");
        let pa = payload("r/x", &a);
        let f = found(&k, &pa);
        let pubkey = PublicKey::from_pem(&k.public_key().to_pem(), "pub").unwrap();
        assert_eq!(pubkey, k.public_key());
        assert!(check(std::slice::from_ref(&f), &pubkey, &a, "r/x:t", "pub.pem").is_ok());

        let other = key().public_key();
        let e = check(std::slice::from_ref(&f), &other, &a, "r/x:t", "pub.pem").unwrap_err();
        assert!(crate::error::is_bad_input(&e));
        assert!(crate::error::one_line(&e).contains("verifies with pub.pem"), "{e:#}");

        let e = check(std::slice::from_ref(&f), &pubkey, &b, "r/x:t", "pub.pem").unwrap_err();
        assert!(crate::error::is_bad_input(&e));
        let line = crate::error::one_line(&e);
        assert!(line.contains("over another digest: its payload names") && line.contains(a.as_str()), "{line}");

        // A tampered payload (another digest, the old signature) verifies with no key.
        let tampered = Found { payload: payload("r/x", &b), ..f.clone() };
        assert!(!tampered.made_by(&pubkey));
        assert!(check(&[tampered, f.clone()], &pubkey, &a, "r/x:t", "k").is_ok(), "one good signature suffices");
        assert!(crate::error::one_line(&check(&[], &pubkey, &a, "r/x:t", "k").unwrap_err()).contains("is not signed"));
    }

    #[test]
    fn malformed_keys_are_refused_on_one_line() {
        let cases = [
            ("not a key", "not a PEM file"),
            ("-----BEGIN PRIVATE KEY-----\n!!!\n-----END PRIVATE KEY-----\n", "not base64"),
            ("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n", "ECDSA P-256"),
            (
                "-----BEGIN ENCRYPTED SIGSTORE PRIVATE KEY-----\nAAAA\n-----END ENCRYPTED SIGSTORE PRIVATE KEY-----\n",
                "encrypted",
            ),
            ("-----BEGIN EC PRIVATE KEY-----\nAAAA\n-----END EC PRIVATE KEY-----\n", "openssl pkcs8 -topk8"),
        ];
        for (text, says) in cases {
            let e = SigningKey::from_pem(text, "k.pem").err().unwrap();
            let line = crate::error::one_line(&e);
            assert!(crate::error::is_bad_input(&e) && line.contains(says) && !line.contains('\n'), "{text}: {line}");
        }
        let e =
            PublicKey::from_pem("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n", "p.pem").unwrap_err();
        assert!(crate::error::one_line(&e).contains("must be P-256"), "{e:#}");
    }

    #[test]
    fn the_signature_manifest_is_cosigns_layout_with_a_subject() {
        let k = key();
        let index = Descriptor::of(crate::oci::manifest::OCI_INDEX, b"{}");
        let p = payload("r/x", &index.digest);
        let sig = STANDARD.encode(k.sign(&p).unwrap());
        let a = signature_artifact(&index, &[signature_layer(&p, &sig)], &p);
        let v: Value = serde_json::from_slice(&a.manifest).unwrap();
        assert_eq!(v["mediaType"], OCI_MANIFEST);
        assert_eq!(v["layers"][0]["mediaType"], SIMPLE_SIGNING_TYPE);
        assert_eq!(v["layers"][0]["annotations"][SIGNATURE_ANNOTATION], sig.as_str());
        assert_eq!(v["subject"]["digest"], index.digest.as_str());
        assert_eq!(v["config"]["digest"], Digest::of(&a.blobs[0]).as_str());
        let config: Value = serde_json::from_slice(&a.blobs[0]).unwrap();
        assert_eq!(config["rootfs"]["diff_ids"][0], Digest::of(&p).as_str());
        let layers = signature_layers(&a.manifest);
        assert_eq!(layers.len(), 1);
        assert_eq!((layers[0].0.digest.clone(), layers[0].1.clone()), (Digest::of(&p), sig));
    }

    /// openssl's keys load, and each side verifies the other's signatures.
    #[test]
    fn openssl_keys_load_and_signatures_cross_verify() {
        if Command::new("openssl").arg("version").output().is_err() {
            eprintln!("openssl not found: skipped");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let p = |n: &str| dir.path().join(n);
        let run = |args: &[&str]| {
            let out = Command::new("openssl").args(args).current_dir(dir.path()).output().unwrap();
            assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        };
        run(&["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", "key.pem"]);
        run(&["pkey", "-in", "key.pem", "-pubout", "-out", "pub.pem"]);
        let k = SigningKey::load(&p("key.pem")).unwrap();
        let pubkey = PublicKey::load(&p("pub.pem")).unwrap();
        assert_eq!(k.public_key(), pubkey);
        assert_eq!(std::fs::read_to_string(p("pub.pem")).unwrap(), pubkey.to_pem());
        let msg = payload("r/x", &Digest::of(b"i"));
        std::fs::write(p("payload.json"), &msg).unwrap();
        std::fs::write(p("ours.der"), k.sign(&msg).unwrap()).unwrap();
        run(&["dgst", "-sha256", "-verify", "pub.pem", "-signature", "ours.der", "payload.json"]);
        run(&["dgst", "-sha256", "-sign", "key.pem", "-out", "theirs.der", "payload.json"]);
        assert!(pubkey.verifies(&msg, &std::fs::read(p("theirs.der")).unwrap()));
        // A P-384 key is named as such.
        run(&["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-384", "-out", "k384.pem"]);
        run(&["pkey", "-in", "k384.pem", "-pubout", "-out", "p384.pem"]);
        let e = SigningKey::load(&p("k384.pem")).err().unwrap();
        assert!(crate::error::one_line(&e).contains("an ECDSA P-384 key"), "{e:#}");
        let e = PublicKey::load(&p("p384.pem")).unwrap_err();
        assert!(crate::error::one_line(&e).contains("an ECDSA P-384 key"), "{e:#}");
    }
}
