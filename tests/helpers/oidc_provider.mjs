// A real OpenID provider for the sign-in tests: panva's oidc-provider (a certified
// implementation) with its development login and consent pages, one confidential client
// (the gateway), accounts with groups, PKCE required, and JWT access tokens for one
// resource (the gateway's API audience). Its settings come as JSON in argv[2].
import fs from "node:fs";
import Provider, { errors } from "oidc-provider";

const cfg = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
const issuer = `http://127.0.0.1:${cfg.port}`;

const provider = new Provider(issuer, {
  clients: [{
    client_id: cfg.client_id,
    client_secret: cfg.client_secret,
    redirect_uris: [cfg.redirect_uri],
    grant_types: ["authorization_code", "client_credentials"],
    response_types: ["code"],
    token_endpoint_auth_method: "client_secret_basic",
  }],
  jwks: { keys: [cfg.jwk] },
  cookies: { keys: ["oidc-test-cookie-key"] },
  claims: {
    openid: ["sub"],
    email: ["email", "email_verified"],
    profile: ["name", "preferred_username"],
    groups: ["groups"],
  },
  scopes: ["openid", "email", "profile", "groups", "api"],
  pkce: { required: () => true, methods: ["S256"] },
  features: {
    devInteractions: { enabled: true },
    clientCredentials: { enabled: true },
    resourceIndicators: {
      enabled: true,
      defaultResource: () => undefined, // the console's sign-in: an opaque token for userinfo
      useGrantedResource: () => false,
      getResourceServerInfo: (ctx, indicator) => {
        if (indicator !== cfg.audience) throw new errors.InvalidTarget();
        return { scope: "api", audience: cfg.audience, accessTokenTTL: 300, accessTokenFormat: "jwt", jwt: { sign: { alg: "RS256" } } };
      },
    },
  },
  extraTokenClaims: (ctx, token) => (token.accountId ? undefined : { groups: cfg.service_groups }),
  findAccount: (ctx, id) => {
    const account = cfg.accounts[id];
    if (!account) return undefined;
    return { accountId: id, claims: () => ({ sub: id, email_verified: true, ...account }) };
  },
});
provider.on("server_error", (ctx, err) => console.error("server_error", err));
provider.listen(cfg.port, "127.0.0.1", () => console.log(`oidc-provider ready on ${issuer}`));
