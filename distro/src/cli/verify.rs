//! `distro verify IMAGE`: fetches the SBOM and provenance attached to a pushed index and checks
//! them against the image; prints one line per mismatch (exit 1), or one line saying what was
//! verified. With `--key PUB.pem` the index must also carry that key's signature over its digest
//! ([`crate::provenance::signature`]); a missing, foreign or misdirected signature is bad input
//! (exit 2, one line), checked before the SBOM and provenance.
use super::parse_index_ref;
use crate::error::bad_input;
use crate::oci::manifest::is_index;
use crate::oci::store::BlobStore;
use crate::provenance::signature::{self, PublicKey, signed_digest};
use crate::provenance::{Attached, INTOTO_TYPE, PLATFORM_ANNOTATION, SBOM_TYPE, Subject, check, referrers};
use crate::registry::auth::Credentials;
use crate::registry::client::Client;
use anyhow::{Result, bail};
use clap::Args;
use serde_json::Value;
use std::path::PathBuf;
use std::process::ExitCode;

/// The arguments of `distro verify`.
#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// The pushed index, by tag or digest (REPO:TAG or REPO@DIGEST).
    #[arg(value_name = "IMAGE")]
    pub image: String,
    /// Registry reachable over plain HTTP (loopback registries always are).
    #[arg(long, value_name = "HOST[:PORT]", value_parser = super::registry_host)]
    pub insecure: Vec<String>,
    /// ECDSA P-256 public key, SPKI PEM (cosign.pub, or `openssl pkey -pubout`): the index must
    /// carry a signature by it over its digest (`distro sign`, `cosign sign --key`).
    #[arg(long, value_name = "PUB.pem")]
    pub key: Option<PathBuf>,
    /// A missing signature is an error (exit 2). Implied by --key; without --key, only its
    /// presence (over this digest) is checked.
    #[arg(long)]
    pub require_signature: bool,
}

/// Runs `distro verify`.
pub fn verify_cmd(a: VerifyArgs) -> Result<ExitCode> {
    let r = parse_index_ref(&a.image)?;
    // The key first: a malformed one is refused before anything is fetched.
    let key = a.key.as_deref().map(PublicKey::load).transpose()?;
    let client = Client::new(Credentials::from_environment(Some(r.api_host()))?, a.insecure)?;
    let top = client.fetch_manifest(&r)?;
    if !is_index(&top.media_type) {
        return Err(bad_input(format!("{r} is a single image manifest; distro verify checks an index distro pushed")));
    }
    let scratch = tempfile::tempdir()?;
    let store = BlobStore::new(scratch.path());
    // The signature first: a missing or wrong one fails before the images are read.
    let (entries, how) = referrers::list(&client, &r, &top.digest)?;
    let signed = check_signature(
        a.key.as_deref(),
        a.require_signature,
        key.as_ref(),
        &client,
        &r.to_string(),
        &r,
        &top.digest,
        &entries,
        &store,
    )?;
    let subject = Subject::read(
        &top.media_type,
        &top.bytes,
        |d| Ok(client.fetch_manifest(&r.with_digest(&d.digest))?.bytes),
        |d| {
            if !store.has(&d.digest) {
                client.fetch_blob(&r, &d.digest, Some(d.size), &store)?;
            }
            Ok(store.path(&d.digest))
        },
    )?;
    let mut attached = Attached::default();
    for e in &entries {
        let kind = e["artifactType"].as_str().unwrap_or("");
        if kind != SBOM_TYPE && kind != INTOTO_TYPE {
            continue;
        }
        let Some(d) = e["digest"].as_str().and_then(|d| crate::oci::digest::Digest::parse(d).ok()) else { continue };
        let m = client.fetch_manifest(&r.with_digest(&d))?;
        let v: Value = serde_json::from_slice(&m.bytes)?;
        if v["subject"]["digest"] != top.digest.as_str() {
            bail!("{}: referrer {d} names another subject, {}", r.name(), v["subject"]["digest"]);
        }
        for l in v["layers"].as_array().into_iter().flatten() {
            let Ok(ld) = serde_json::from_value::<crate::oci::manifest::Descriptor>(l.clone()) else { continue };
            client.fetch_blob(&r, &ld.digest, Some(ld.size), &store)?;
            let bytes = store.read(&ld.digest)?;
            if kind == SBOM_TYPE {
                attached.sbom_artifact = true;
                let p = l["annotations"][PLATFORM_ANNOTATION].as_str().unwrap_or("unknown").to_owned();
                attached.sboms.insert(p, bytes);
            } else {
                attached.statements.push(bytes);
            }
        }
    }
    let mismatches = check(&subject, &attached);
    for m in &mismatches {
        println!("{m}");
    }
    if !mismatches.is_empty() {
        bail!(
            "{r} ({}): {} mismatch(es) between the image and what is attached to it ({how})",
            top.digest,
            mismatches.len()
        );
    }
    println!(
        "verified {r} ({}): SBOM of {} platform(s), {} provenance statement(s), found through the {how}{signed}",
        top.digest,
        attached.sboms.len(),
        attached.statements.len()
    );
    Ok(ExitCode::SUCCESS)
}

/// The signature check: with a key, one of the signatures found must be the key's over `subject`;
/// without one, `--require-signature` asks for a signature whose payload names `subject`.
/// Returns what the final line says about it (empty when nothing was asked: no signature is read).
fn check_signature(
    key_path: Option<&std::path::Path>,
    require_signature: bool,
    key: Option<&PublicKey>,
    client: &Client,
    image: &str,
    r: &crate::registry::reference::Reference,
    subject: &crate::oci::digest::Digest,
    entries: &[Value],
    store: &BlobStore,
) -> Result<String> {
    if key.is_none() && !require_signature {
        // Nothing asked: verify reads no signature, as before signing existed.
        return Ok(String::new());
    }
    let found = signature::fetch(client, r, subject, entries, store)?;
    match key {
        Some(key) => {
            let key_name = key_path.map(|p| p.display().to_string()).unwrap_or_default();
            let f = signature::check(&found, key, subject, image, &key_name)?;
            Ok(format!("; signed with {key_name} ({})", f.source))
        }
        None if found.is_empty() => Err(signature::missing(image, subject)),
        None => {
            if !found.iter().any(|f| signed_digest(&f.payload).as_deref() == Some(subject.as_str())) {
                return Err(bad_input(format!(
                    "{image} ({subject}): its {} signature(s) ({}) are over another digest",
                    found.len(),
                    found.iter().map(|f| f.source.as_str()).collect::<Vec<_>>().join(", ")
                )));
            }
            Ok(format!("; {} signature(s) present, not checked (no --key)", found.len()))
        }
    }
}
