//! Tag listing and manifest deletion (`distro triage`, `distro retention`).
use super::auth::Scope;
use super::client::{Client, Request, error_text};
use super::reference::Reference;
use crate::oci::digest::Digest;
use anyhow::{Context, Result, bail};
use reqwest::Method;

impl Client {
    /// Every tag of `r`'s repository (`GET /v2/<name>/tags/list`, following `Link` pages).
    pub fn list_tags(&self, r: &Reference) -> Result<Vec<String>> {
        let host = r.api_host();
        let mut url = self.api_url(host, &r.repository, "tags/list?n=1000")?;
        let mut tags = Vec::new();
        loop {
            let resp = self.send(
                host,
                &Request::new(Method::GET, url.clone(), vec![Scope::repository(&r.repository, &["pull"])]),
            )?;
            match resp.status().as_u16() {
                200 => {}
                404 => return Ok(tags), // an unknown repository has no tags
                _ => bail!("{}: listing tags: {}", r.name(), error_text(resp)),
            }
            let next = resp.headers().get("link").and_then(|v| v.to_str().ok()).and_then(next_link);
            #[derive(serde::Deserialize)]
            struct List {
                #[serde(default)]
                tags: Option<Vec<String>>,
            }
            let body = resp.bytes().with_context(|| format!("{}: reading the tag list", r.name()))?;
            let list: List =
                serde_json::from_slice(&body).with_context(|| format!("{}: the tag list is not JSON", r.name()))?;
            tags.extend(list.tags.unwrap_or_default());
            match next {
                Some(n) => url = url.join(&n)?,
                None => break,
            }
        }
        tags.sort();
        tags.dedup();
        Ok(tags)
    }

    /// Deletes the manifest `digest` of `r`'s repository (`DELETE /v2/<name>/manifests/<digest>`):
    /// every tag pointing at it goes with it.
    pub fn delete_manifest(&self, r: &Reference, digest: &Digest) -> Result<()> {
        let host = r.api_host();
        let url = self.api_url(host, &r.repository, &format!("manifests/{digest}"))?;
        let scopes = vec![Scope::repository(&r.repository, &["pull", "push", "delete"])];
        let resp = self.send(host, &Request::new(Method::DELETE, url, scopes))?;
        match resp.status().as_u16() {
            200 | 202 => Ok(()),
            404 => Ok(()), // already gone
            405 => bail!(
                "{}: the registry does not allow deletes (HTTP 405; the distribution registry needs storage.delete.enabled: true)",
                r.name()
            ),
            _ => bail!("{}: deleting {digest}: {}", r.name(), error_text(resp)),
        }
    }
}

/// The target of a `Link: <URL>; rel="next"` header.
fn next_link(header: &str) -> Option<String> {
    header.split(',').find_map(|part| {
        let (target, params) = part.split_once(';')?;
        params.contains("rel=\"next\"").then(|| target.trim().trim_start_matches('<').trim_end_matches('>').to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_link_is_read_from_the_header() {
        assert_eq!(
            next_link("</v2/x/tags/list?n=2&last=b>; rel=\"next\"").as_deref(),
            Some("/v2/x/tags/list?n=2&last=b")
        );
        assert_eq!(next_link("</v2/x/tags/list?n=2&last=b>; rel=\"prev\""), None);
    }
}
