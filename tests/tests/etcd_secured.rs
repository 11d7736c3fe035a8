//! The etcd exchange against a real etcd that serves TLS only, requires client
//! certificates and has authentication on (feature `etcd`). Certificates are made
//! here: a CA, etcd's server certificate, a client certificate, and a second,
//! untrusted CA with a certificate of its own.

#[cfg(not(feature = "etcd"))]
#[test]
fn secured_etcd() {
    nixl_conformance::support::skip(
        "secured etcd tests",
        "built without the `etcd` feature (needs protobuf-compiler and libprotobuf-dev; scripts/test enables it when protoc is present)",
    );
}

#[cfg(feature = "etcd")]
mod with_etcd {
    use std::path::{Path, PathBuf};
    use std::time::Duration;

    use nixl::exchange::etcd_client::{self, Permission};
    use nixl::exchange::{EtcdAuth, EtcdExchange, EtcdOptions, EtcdTls};
    use nixl::ErrorKind;
    use nixl_conformance::etcd_server::{EtcdServer, ServerTls};
    use nixl_conformance::support::bounded;
    use nixl_conformance::support::tcp_agent as agent;
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    };

    const NS: &str = "secured";
    const PASSWORD: &str = "correct horse";

    struct Pem {
        cert: String,
        key: String,
    }

    fn ca(name: &str) -> (Pem, Issuer<'static, KeyPair>) {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate().unwrap();
        let cert = p.self_signed(&key).unwrap();
        let pem = Pem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        };
        (pem, Issuer::new(p, key))
    }

    fn leaf(
        cn: &str,
        sans: &[&str],
        usage: ExtendedKeyUsagePurpose,
        by: &Issuer<'_, KeyPair>,
    ) -> Pem {
        let mut p =
            CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        p.distinguished_name.push(DnType::CommonName, cn);
        p.extended_key_usages = vec![usage];
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, by).unwrap();
        Pem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    fn tls(ca: &Pem, client: &Pem) -> EtcdTls {
        EtcdTls {
            ca_pem: ca.cert.clone().into_bytes(),
            identity: Some((
                client.cert.clone().into_bytes(),
                client.key.clone().into_bytes(),
            )),
            domain: None,
        }
    }

    fn options(etcd: &EtcdServer, tls: Option<EtcdTls>, auth: Option<(&str, &str)>) -> EtcdOptions {
        EtcdOptions {
            endpoints: vec![etcd.endpoint()],
            namespace: NS.into(),
            lease_ttl: Duration::from_secs(5),
            timeout: Duration::from_secs(3),
            max_backoff: Duration::from_millis(500),
            tls,
            auth: auth.map(|(u, p)| EtcdAuth {
                user: u.into(),
                password: p.into(),
            }),
            layout: Default::default(),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tls_and_auth_admit_only_the_right_credentials() {
        let dir = std::env::temp_dir().join(format!("nixl-etcd-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (ca_pem, issuer) = ca("nixl test CA");
        let server = leaf(
            "etcd",
            &["127.0.0.1", "localhost"],
            ExtendedKeyUsagePurpose::ServerAuth,
            &issuer,
        );
        // etcd takes a client certificate's CN as the user when no password is given:
        // this one names no user.
        let client = leaf(
            "nixl-client",
            &[],
            ExtendedKeyUsagePurpose::ClientAuth,
            &issuer,
        );
        let (rogue_ca, rogue) = ca("rogue CA");
        let rogue_client = leaf(
            "nixl-client",
            &[],
            ExtendedKeyUsagePurpose::ClientAuth,
            &rogue,
        );
        let server_tls = ServerTls {
            cert: write(&dir, "server.pem", &server.cert),
            key: write(&dir, "server.key", &server.key),
            client_ca: write(&dir, "ca.pem", &ca_pem.cert),
            // Tokens expire after a second: the exchange must log in again.
            args: vec!["--auth-token-ttl=1".into()],
        };
        let good = tls(&ca_pem, &client);
        let probe = etcd_client::ConnectOptions::new().with_tls(
            etcd_client::TlsOptions::new()
                .ca_certificate(etcd_client::Certificate::from_pem(&ca_pem.cert))
                .identity(etcd_client::Identity::from_pem(&client.cert, &client.key)),
        );
        let Some(etcd) = EtcdServer::start_tls(
            "tls_and_auth_admit_only_the_right_credentials",
            server_tls,
            probe,
        )
        .await
        else {
            return;
        };

        // Authentication on: root, and a user `nixl` that may read and write the
        // exchange's namespace only.
        let mut admin = options(&etcd, Some(good.clone()), None)
            .client()
            .await
            .unwrap();
        admin.user_add("root", "root-pw", None).await.unwrap();
        admin.user_grant_role("root", "root").await.unwrap();
        admin.role_add("nixl").await.unwrap();
        let prefix = format!("/{NS}/");
        admin
            .role_grant_permission(
                "nixl",
                Permission::read_write(prefix.as_bytes()).with_prefix(),
            )
            .await
            .unwrap();
        admin.user_add("nixl", PASSWORD, None).await.unwrap();
        admin.user_grant_role("nixl", "nixl").await.unwrap();
        admin.auth_enable().await.unwrap();

        // The right credentials: publish and fetch.
        let a = agent("a").await;
        let b = agent("b").await;
        let xa = EtcdExchange::connect(
            &a,
            options(&etcd, Some(good.clone()), Some(("nixl", PASSWORD))),
        )
        .await
        .unwrap();
        xa.publish().await.unwrap();
        let xb = EtcdExchange::connect(
            &b,
            options(&etcd, Some(good.clone()), Some(("nixl", PASSWORD))),
        )
        .await
        .unwrap();
        bounded("fetch", xb.fetch("a", Duration::from_secs(5)))
            .await
            .unwrap();
        assert!(b.peers().contains(&"a".to_string()));

        // Wrong password, no password: refused, nothing read.
        for (what, auth) in [
            ("wrong password", Some(("nixl", "wrong"))),
            ("no password", None),
        ] {
            let c = agent("c").await;
            let e = bounded(
                what,
                EtcdExchange::connect(&c, options(&etcd, Some(good.clone()), auth)),
            )
            .await
            .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::NotAllowed, "{what}: {e}");
            let e = bounded(what, async {
                let mut raw = options(&etcd, Some(good.clone()), auth).client().await?;
                raw.get(
                    prefix.as_bytes(),
                    Some(etcd_client::GetOptions::new().with_prefix()),
                )
                .await
                .map_err(|e| nixl::Error::new(ErrorKind::Backend, "read", "refused").with_source(e))
            })
            .await
            .unwrap_err();
            assert!(
                matches!(e.kind(), ErrorKind::NotAllowed | ErrorKind::Backend),
                "{what}: {e}"
            );
            let _ = c.shutdown().await;
        }
        // The user's permissions end at the namespace.
        let mut user = options(&etcd, Some(good.clone()), Some(("nixl", PASSWORD)))
            .client()
            .await
            .unwrap();
        assert!(user.get("/elsewhere", None).await.is_err());

        // TLS that does not verify: a server certificate from an untrusted CA, a client
        // certificate etcd does not trust, plain http to the TLS port.
        let wrong_ca = EtcdTls {
            ca_pem: rogue_ca.cert.clone().into_bytes(),
            ..good.clone()
        };
        let rogue_identity = tls(&ca_pem, &rogue_client);
        let plain = EtcdOptions {
            endpoints: vec![etcd.endpoint().replacen("https", "http", 1)],
            ..options(&etcd, None, Some(("nixl", PASSWORD)))
        };
        for (what, o) in [
            (
                "untrusted server certificate",
                options(&etcd, Some(wrong_ca), Some(("nixl", PASSWORD))),
            ),
            (
                "untrusted client certificate",
                options(&etcd, Some(rogue_identity), Some(("nixl", PASSWORD))),
            ),
            ("plain http", plain),
        ] {
            let c = agent("d").await;
            let e = bounded(what, EtcdExchange::connect(&c, o))
                .await
                .unwrap_err();
            assert!(
                matches!(e.kind(), ErrorKind::Backend | ErrorKind::TimedOut),
                "{what}: {e}"
            );
            println!("{what}: {e}");
            let _ = c.shutdown().await;
        }
        // Tokens expired meanwhile: publishing and fetching still work.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let r = a.register(vec![0u8; 64]).unwrap();
        bounded(
            "publish after the token expired",
            xa.publish_partial("later", std::slice::from_ref(&r), false),
        )
        .await
        .unwrap();
        bounded(
            "fetch after the token expired",
            xb.fetch_partial("a", "later", Duration::from_secs(5)),
        )
        .await
        .unwrap();
        nixl_conformance::support::figure(
            "secured etcd",
            "TLS with client certificates and user/password auth: the right credentials publish and fetch; wrong or missing password (NotAllowed), untrusted server or client certificate and plain http (Backend) are refused",
        );
        let _ = a.shutdown().await;
        let _ = b.shutdown().await;
        let _ = std::fs::remove_dir_all(&dir);
    }
}
