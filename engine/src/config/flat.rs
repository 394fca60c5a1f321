//! A configuration as flat `key = value` pairs (`optim.lr = 0.001`), the values as TOML writes
//! them: what a resumed run compares with its checkpoint's configuration key by key
//! (`checkpoint/resume.rs`), and what the ranks of a job compare at the rendezvous
//! (`parallel/job.rs`), so that a refusal can name each key and both of its values.

use std::collections::BTreeMap;

use super::Config;

/// Every key of `config` with its value, in key order; arrays (a mixture's sources) are one
/// value each.
pub fn flatten(config: &Config) -> BTreeMap<String, String> {
    fn walk(prefix: &str, v: &toml::Value, out: &mut BTreeMap<String, String>) {
        match v {
            toml::Value::Table(t) => {
                for (k, v) in t {
                    let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                    walk(&key, v, out);
                }
            }
            other => {
                out.insert(prefix.to_owned(), other.to_string());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk("", &toml::Value::try_from(config).expect("configs serialize"), &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_dotted_and_values_are_toml() {
        let mut config = Config::default();
        config.optim.lr = 0.5;
        let flat = flatten(&config);
        assert_eq!(flat["optim.lr"], "0.5");
        assert_eq!(flat["train.steps"], config.train.steps.to_string());
        assert!(flat["data.source"].starts_with('"'), "{}", flat["data.source"]);
    }
}
