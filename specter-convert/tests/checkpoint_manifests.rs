//! The tensor maps in manifests/ against real checkpoints: each map, expanded with a fixture's
//! config.json, must list exactly the fixture's tensors (written by transformers) with their shapes.

// The root crate's test helpers: the repository root, where manifests/ and the fixtures are.
#[path = "../../tests/common/mod.rs"]
mod common;

use std::collections::BTreeMap;

use serde_json::Value;
use specter::arch::SUPPORTED_MODEL_TYPES;
use specter_convert::checkpoint::Checkpoint;

fn manifest(model_type: &str) -> Value {
    let path = common::repo_root()
        .join("manifests")
        .join(format!("{model_type}.json"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// A config.json with a manifest's aliases and defaults behind it.
struct Scope<'a> {
    config: &'a Value,
    aliases: &'a Value,
    defaults: &'a Value,
}

impl Scope<'_> {
    /// The key's value under its own name or, failing that, under one of its aliases.
    fn lookup(&self, key: &str) -> Option<&Value> {
        let alias_values = self
            .aliases
            .get(key)
            .and_then(|a| a.as_array())
            .into_iter()
            .flatten();
        std::iter::once(self.config.get(key))
            .chain(alias_values.map(|a| a.as_str().and_then(|a| self.config.get(a))))
            .flatten()
            .find(|v| !v.is_null())
            .or_else(|| self.config.get(key))
    }

    fn value(&self, key: &str) -> Value {
        match self.lookup(key) {
            Some(v) if !v.is_null() || self.defaults.get(key).is_none() => v.clone(),
            _ => match self.defaults.get(key) {
                Some(Value::String(expr)) => Value::from(self.eval(expr)),
                Some(v) => v.clone(),
                None => Value::Null,
            },
        }
    }

    fn truthy(&self, key: &str) -> bool {
        match self.value(key) {
            Value::Null => false,
            Value::Bool(b) => b,
            Value::Number(n) => n.as_f64() != Some(0.0),
            Value::String(s) => !s.is_empty(),
            Value::Array(a) => !a.is_empty(),
            Value::Object(o) => !o.is_empty(),
        }
    }

    fn holds(&self, cond: Option<&Value>) -> bool {
        let Some(cond) = cond.and_then(|c| c.as_str()) else {
            return true;
        };
        cond.split('&').all(|c| match c.strip_prefix('!') {
            Some(k) => !self.truthy(k),
            None => self.truthy(c),
        })
    }

    fn atom(&self, a: &str) -> usize {
        match a.parse::<usize>() {
            Ok(n) => n,
            Err(_) => self
                .value(a)
                .as_u64()
                .unwrap_or_else(|| panic!("manifest key {a} is not a number in the config"))
                as usize,
        }
    }

    fn eval(&self, expr: &str) -> usize {
        expr.split('+')
            .map(|term| {
                let mut acc: Option<usize> = None;
                let mut op = '*';
                let mut token = String::new();
                for ch in term.chars().chain(std::iter::once('\0')) {
                    if ch == '*' || ch == '/' || ch == '\0' {
                        let v = self.atom(token.trim());
                        acc = Some(match (acc, op) {
                            (None, _) => v,
                            (Some(a), '*') => a * v,
                            (Some(a), _) => a / v,
                        });
                        op = ch;
                        token.clear();
                    } else {
                        token.push(ch);
                    }
                }
                acc.unwrap()
            })
            .sum()
    }
}

fn is_moe_layer(m: &Value, s: &Scope, l: usize) -> bool {
    let rule = &m["moe_layers"];
    match rule["rule"].as_str().unwrap() {
        "all" => true,
        "first_k_dense" => {
            l >= s.atom(rule["first_k_dense"].as_str().unwrap())
                && l.is_multiple_of(s.atom(rule["every"].as_str().unwrap()))
        }
        "sparse_step" => {
            let except: Vec<u64> = s
                .value(rule["except"].as_str().unwrap())
                .as_array()
                .map(|a| a.iter().filter_map(|v| v.as_u64()).collect())
                .unwrap_or_default();
            !except.contains(&(l as u64))
                && s.atom(rule["num_experts"].as_str().unwrap()) > 0
                && (l + 1).is_multiple_of(s.atom(rule["step"].as_str().unwrap()))
        }
        other => panic!("unknown moe_layers rule {other}"),
    }
}

/// Every tensor the manifest says a checkpoint with this config holds.
fn expand(m: &Value, config: &Value) -> BTreeMap<String, Vec<usize>> {
    let s = Scope {
        config,
        aliases: &m["aliases"],
        defaults: &m["defaults"],
    };
    let mut out = BTreeMap::new();
    let mut add = |entry: &Value, l: Option<usize>, e: Option<usize>| {
        if !s.holds(entry.get("when")) {
            return;
        }
        let mut name = entry["name"].as_str().unwrap().to_string();
        if let Some(l) = l {
            name = name.replace("{l}", &l.to_string());
        }
        if let Some(e) = e {
            name = name.replace("{e}", &e.to_string());
        }
        let shape = entry["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| match d {
                Value::Number(n) => n.as_u64().unwrap() as usize,
                Value::String(x) => s.eval(x),
                other => panic!("bad dim {other}"),
            })
            .collect();
        assert!(
            out.insert(name.clone(), shape).is_none(),
            "{name} listed twice"
        );
    };
    for entry in m["global"].as_array().unwrap() {
        add(entry, None, None);
    }
    let layers = s.atom("num_hidden_layers");
    let experts = s.eval(m["num_experts"].as_str().unwrap());
    for l in 0..layers {
        for entry in m["layer"].as_array().unwrap() {
            add(entry, Some(l), None);
        }
        if is_moe_layer(m, &s, l) {
            for entry in m["moe_layer"].as_array().unwrap() {
                add(entry, Some(l), None);
            }
            for e in 0..experts {
                for proj in ["gate", "up", "down"] {
                    add(&m["expert"][proj], Some(l), Some(e));
                }
            }
        } else {
            for entry in m["dense_layer"].as_array().unwrap() {
                add(entry, Some(l), None);
            }
        }
    }
    out
}

#[test]
fn manifests_list_exactly_the_fixture_tensors() {
    let fixtures = common::repo_root().join("tests/fixtures");
    let mut checked = 0;
    for item in std::fs::read_dir(&fixtures).unwrap() {
        let dir = item.unwrap().path();
        if !dir.join("config.json").exists() {
            continue;
        }
        let ck = Checkpoint::open(&dir).unwrap();
        let config: Value = serde_json::from_str(ck.config_json()).unwrap();
        let m = manifest(config["model_type"].as_str().unwrap());
        let want = expand(&m, &config);
        let got: BTreeMap<String, Vec<usize>> = ck
            .tensor_names()
            .into_iter()
            .map(|n| (n.clone(), ck.shape(&n).unwrap()))
            .collect();
        let missing: Vec<_> = want.keys().filter(|k| !got.contains_key(*k)).collect();
        let extra: Vec<_> = got.keys().filter(|k| !want.contains_key(*k)).collect();
        assert!(
            missing.is_empty() && extra.is_empty(),
            "{}: missing {missing:?}, extra {extra:?}",
            dir.display()
        );
        assert_eq!(want, got, "{}", dir.display());
        checked += 1;
    }
    assert!(
        checked >= SUPPORTED_MODEL_TYPES.len(),
        "only {checked} fixtures found"
    );
}

/// The manifests and the architecture code's tensor list agree, on the tiny configs and on the
/// benchmark presets.
#[test]
fn manifests_agree_with_expected_tensors() {
    let mut configs: Vec<String> = specter_convert::synth::FIXTURE_CONFIGS
        .iter()
        .map(|n| specter_convert::synth::fixture_config(n).unwrap())
        .collect();
    for p in specter_convert::synth::PRESETS {
        configs.push(specter_convert::synth::preset_config_layers(p, Some(3)).unwrap());
    }
    for text in configs {
        let config: Value = serde_json::from_str(&text).unwrap();
        let m = manifest(config["model_type"].as_str().unwrap());
        let want = expand(&m, &config);
        let cfg = specter::arch::ArchConfig::from_config_json(&text).unwrap();
        let got: BTreeMap<String, Vec<usize>> = specter::arch::expected_tensors(&cfg)
            .into_iter()
            .map(|s| (s.name, s.shape))
            .collect();
        assert_eq!(want, got, "{}", config["model_type"]);
    }
}

#[test]
fn manifests_are_well_formed() {
    // One manifest for each architecture the runtime supports.
    for arch in SUPPORTED_MODEL_TYPES {
        let m = manifest(arch);
        assert_eq!(m["model_type"], *arch);
        assert!(m["schema"]
            .as_str()
            .unwrap()
            .starts_with("specter tensor map v1"));
        for proj in ["gate", "up", "down"] {
            let name = m["expert"][proj]["name"].as_str().unwrap();
            assert!(
                name.contains("{l}") && name.contains("{e}"),
                "{arch} {proj}: {name}"
            );
        }
        let fused = &m["transformers5_fused"];
        assert!(fused["gate_up"]
            .as_str()
            .unwrap()
            .ends_with(".experts.gate_up_proj"));
        assert!(fused["down"]
            .as_str()
            .unwrap()
            .ends_with(".experts.down_proj"));
    }
}

/// The expression evaluator itself, so that a wrong shape cannot hide behind a wrong evaluator.
#[test]
fn expressions_and_conditions_evaluate() {
    let config: Value =
        serde_json::json!({"a": 6, "b": 4, "c": null, "t": true, "z": 0, "list": []});
    let defaults: Value = serde_json::json!({"c": "a*b", "d": 3});
    let aliases: Value = serde_json::json!({"e": ["missing", "b"]});
    let s = Scope {
        config: &config,
        aliases: &aliases,
        defaults: &defaults,
    };
    assert_eq!(s.eval("e*2"), 8);
    assert_eq!(s.eval("a*b+d"), 27);
    assert_eq!(s.eval("a/b*b"), 4);
    assert_eq!(s.eval("c+1"), 25);
    assert_eq!(s.eval("2*a+a*d"), 30);
    assert!(s.holds(Some(&Value::from("t&a"))));
    assert!(!s.holds(Some(&Value::from("t&z"))));
    assert!(s.holds(Some(&Value::from("!list&!z"))));
    assert!(!s.holds(Some(&Value::from("!c"))));
}
