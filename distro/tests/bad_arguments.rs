//! Arguments that cannot be right are refused before anything is fetched, built or written:
//! exit code 2 and one line naming the flag and the value.
use std::process::Command;

fn distro(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_distro"))
        .args(args)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .expect("distro runs");
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn impossible_arguments_are_refused_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"not a layout").unwrap();
    let file_arg = file.to_str().unwrap();
    let site = dir.path().join("site");
    let site_arg = site.to_str().unwrap();
    // A test summary of 400 MB (sparse): attach-test refuses it before reading or sending it.
    let huge = dir.path().join("summary.json");
    std::fs::File::create(&huge).unwrap().set_len(400_000_000).unwrap();
    let huge_arg = huge.to_str().unwrap();
    let cases: [(&[&str], &str); 21] = [
        (&["build", "--platform", "linux/amd64", "--push", "127.0.0.1:9/r"], "the index would lack linux/arm64"),
        (&["push", "--chunk-size", "0", "layout", "127.0.0.1:9/r"], "is not a chunk size"),
        (&["build", "--image", "../../x"], "`../../x` is not an image name"),
        (&["sbom", "--image", "/etc/passwd"], "`/etc/passwd` is not an image name"),
        (&["triage", "--image", "a/b", "--repo", "127.0.0.1:9/r"], "`a/b` is not an image name"),
        (&["build", "--date", "0000-01-01"], "`0000-01-01` is not a date YYYY-MM-DD from 1970-01-01 on"),
        (&["build", "--date", "2026-02-30"], "`2026-02-30` is not a date"),
        (&["push", "--insecure", "http://127.0.0.1:5000", "layout", "127.0.0.1:5000/r"], "is not HOST[:PORT]"),
        (&["build", "--output", file_arg], "exists and is not a directory"),
        (&["verify", "127.0.0.1:9/r"], "name the index by tag or digest"),
        (&["triage", "--good", "2026-03-01", "--bad", "127.0.0.1:9/r:b", "--", "true"], "a date needs --repo"),
        (
            &["report", "--repo", "127.0.0.1:9/r", "--since", "2026-02-30", "--out", site_arg],
            "`2026-02-30` is not a date",
        ),
        (&["report", "--repo", "127.0.0.1:9/r:t", "--out", site_arg], "give the repository without a tag or digest"),
        (&["attach-test", "127.0.0.1:9/r", file_arg, "--platform", "linux/amd64"], "name the index by tag or digest"),
        (
            &["attach-test", "127.0.0.1:9/r:t", file_arg, "--platform", "linux/amd64"],
            "a-file: not a test-all summary.json",
        ),
        (
            &["attach-test", "127.0.0.1:9/r:t", huge_arg, "--platform", "linux/amd64"],
            "summary.json: larger than 4194304 bytes (4 MiB), the most a test summary may have",
        ),
        (
            &["attach-test", "127.0.0.1:9/r:t", file_arg, "--platform", "linux/s390x"],
            "\"linux/s390x\" is not supported",
        ),
        // Keys are read before the registry (nobody answers at 127.0.0.1:9) is asked anything.
        (&["sign", "127.0.0.1:9/r:t", "--key", file_arg], "a-file: not a PEM file"),
        (&["sign", "127.0.0.1:9/r:t", "--key", "/nonexistent/key.pem"], "--key /nonexistent/key.pem"),
        (&["sign", "127.0.0.1:9/r", "--key", file_arg], "name the index by tag or digest"),
        (&["verify", "127.0.0.1:9/r:t", "--key", file_arg], "a-file: not a PEM file"),
    ];
    for (args, expected) in cases {
        let (code, stderr) = distro(args);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: expected `{expected}` in: {stderr}");
        assert!(!stderr.contains("resolving base"), "{args:?} started building: {stderr}");
        assert_eq!(stderr.lines().filter(|l| !l.is_empty()).count(), 1, "{args:?}: more than one line: {stderr}");
    }
    assert_eq!(std::fs::read(&file).unwrap(), b"not a layout", "the file named by --output was touched");
    assert!(!site.exists(), "distro report wrote its site before refusing");
}

/// A registry nobody answers at is a fault that may pass: exit 75 after the retries, one error
/// line, and no site written.
#[test]
fn distro_report_of_an_unreachable_registry_exits_75() {
    let dir = tempfile::tempdir().unwrap();
    let site = dir.path().join("site");
    let (code, stderr) = distro(&["report", "--repo", "127.0.0.1:9/r", "--out", site.to_str().unwrap()]);
    assert_eq!(code, Some(75), "{stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    assert!(
        errors[0].starts_with("error: the registry cannot be reached (GET http://127.0.0.1:9/v2/r/tags/list"),
        "{stderr}"
    );
    assert!(!site.exists());
}

#[test]
fn a_docker_endpoint_distro_cannot_reach_is_refused_in_one_line() {
    for args in [&["load", "no-such-layout"][..], &["run", "img"][..]] {
        let out = Command::new(env!("CARGO_BIN_EXE_distro"))
            .args(args)
            .env("DOCKER_HOST", "tcp://127.0.0.1:9")
            .output()
            .expect("distro runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.starts_with("error: DOCKER_HOST=tcp://127.0.0.1:9: distro load and distro run reach"),
            "{stderr}"
        );
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
    }
}
